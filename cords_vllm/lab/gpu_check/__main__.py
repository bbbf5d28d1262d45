"""``python -m cords_vllm.lab.gpu_check`` (what ``scripts/gpu-check.sh`` runs)."""

import sys

from cords_vllm.lab.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
