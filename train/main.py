"""DraftSmith's entry point: run a recipe's stages (regenerate -> cache -> train -> opd -> eval -> export).

    torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m --stages regenerate,cache --set data.num_prompts=64
    python train/main.py --list-recipes
    python train/main.py --target PATH_OR_ID --prompts FILE --family dspark   # your own target, no recipe

A script, not a module: the driver is pipeline.py.
"""

import sys
from pathlib import Path

# `python train/main.py` puts train/ first on sys.path; the project root must come first so that the top-level
# packages resolve even without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
