"""One live stream for hours of video through ``vllm serve``: KV held, server memory and push cost per push.

One camera streams ``hours`` of synthetic video at ``fps`` into one stream of the stream API (``/v1/streams``), in
clips of ``clip_frames`` frames of ``size x size`` pixels, as fast as the server takes them (no real-time
pacing). The model is a tiny video-QA checkpoint (the shipped one by default, or one fine-tuned on
:mod:`cords_vllm.lab.vqa.stream_task` examples as well), served with Qwen2-VL-7B's rotary range:
``--hf-overrides`` sets its text config's ``max_position_embeddings`` to ``max_positions`` (32768), and
``--mm-processor-kwargs max_pixels`` keeps frames at their size, so a clip has Qwen2-VL-7B's geometry (8 frames
of 448 x 448: 1,024 video tokens, 18 rotary positions with its markers). :func:`check_position_range` proves the
served range: a ``--max-model-len`` one past it is refused.

Under ``none`` the stream ends with a 410 at ``--max-model-len`` tokens (the rotary range); under ``cords`` it is
re-based at every push, so its KV stays flat and its limit is its rotary positions (a 410 naming "rotary
positions" when they run out). Each push records the video pushed so far, the KV blocks the stream holds (the
stream listing, published up to 0.5 s late, and the pool's usage from ``/metrics``, exact: the stream is the only
request), the resident memory of every server process and the push's wall time.

Questions with known answers (the shipped model's families, :mod:`cords_vllm.lab.vqa.tasks`): every
``ask_every_min`` minutes of video (a *checkpoint*) the stream is asked two questions:

* *old*, "What color was the square?", two pushes before the checkpoint: a square (the ``colour`` family's needle)
  was shown for one temporal patch ``old_event_min`` minutes before; it is the only square since the previous
  checkpoint;
* *recent*, "What color is the dot?", after the push that reaches the checkpoint: a small dot of one colour (the
  ``static`` family's mark) is shown in every frame of the clip before the last one, so the event ended one clip
  (``clip_frames / fps`` seconds) before the question.

The old question is asked before the dot is shown, so it asks whether the stream still holds the square; with
``old_after_recent`` (``--old-after-recent``) it is asked after the dot, with the recent question, and the model
must also tell a square from a newer dot.

Earlier checkpoints' marks may still be held: each checkpoint's colours differ from the previous one's, and a
wrong answer naming the colour of another mark asked about (an earlier checkpoint's, or this checkpoint's other
one) is recorded as ``stale``. The one-shot checkpoint (trained on one mark per video) names the most salient
mark whatever is asked once a stream holds several, under ``none`` too; :mod:`cords_vllm.lab.vqa.stream_task`
draws training examples of this shape (the latest mark of the kind asked, older clips partly held, position gaps)
for a checkpoint that tells marks apart (``train_vqa.py --stream-batch``; see docs/results.md).

Its parts: :mod:`~.plan` (the settings, the questions, the video), :mod:`~.serve` (the servers' flags),
:mod:`~.records` (what a run records), :mod:`~.run` (one policy's run) and :mod:`~.report` (summary, table, plot).
"""

from __future__ import annotations

from cords_vllm.lab.bench.stream_hours.plan import (
    MARKERS,
    QUESTIONS,
    HoursConfig,
    Question,
    StreamVideo,
    draw_event,
    plan_questions,
)
from cords_vllm.lab.bench.stream_hours.records import PolicyRun, PushRecord, QuestionRecord
from cords_vllm.lab.bench.stream_hours.report import (
    agreement_with_none,
    format_summary,
    plot_runs,
    rss_growth,
    summarise,
    write_results,
)
from cords_vllm.lab.bench.stream_hours.run import cpu_seconds, named_colour, run_policy
from cords_vllm.lab.bench.stream_hours.serve import check_position_range, position_flags, serve_flags

__all__ = [
    "MARKERS", "QUESTIONS", "HoursConfig", "PolicyRun", "PushRecord", "Question", "QuestionRecord", "StreamVideo",
    "agreement_with_none", "check_position_range", "cpu_seconds", "draw_event", "format_summary", "named_colour",
    "plan_questions", "plot_runs", "position_flags", "rss_growth", "run_policy", "serve_flags", "summarise",
    "write_results",
]
