"""Check every vLLM-internal name rollout-parity reaches, in a vLLM source tree, a wheel or the installed vLLM.

    python scripts/vllm_names.py /path/to/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python scripts/vllm_names.py /path/to/vllm/checkout [--version 0.33.0]
    python scripts/vllm_names.py                     # the installed vLLM (imported)

The table and both readers are ``rollout_parity/engines/vllm/names.py``; exit 1 on a missing name.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_parity.engines.vllm.names import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
