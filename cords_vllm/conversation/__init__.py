"""A live stream's conversation as text: each turn's chat markup (:mod:`~.transcript`) and the count of its
protected tokens against ``max_text_tokens`` (:mod:`~.text_budget`). Pure: no vLLM, no I/O."""
