"""Command-line conventions shared by ``rollout-parity doctor``/``check``/``launch`` and TRL's parser.

* One spelling: options are snake_case (TRL's and verl's own), the kebab-case form is an alias.
* Switches take an optional ``true``/``false`` value, as TRL's ``HfArgumentParser`` does for bool
  fields (``--fp32_lm_head``, ``--fp32_lm_head true``, ``--fp32_lm_head false``).
* No abbreviations (argparse would read ``--rollout_importance_sampling_mod`` as ``..._mode``):
  an unknown option is refused in one line naming the closest known one.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable, Optional, Sequence

from rollout_parity.core.config import did_you_mean

__all__ = ["TRUE_WORDS", "FALSE_WORDS", "bool_value", "spellings", "add_switch", "unknown_option",
           "normalise_switches"]

TRUE_WORDS = ("true", "yes", "y", "1", "t")
FALSE_WORDS = ("false", "no", "n", "0", "f")


def bool_value(text: Any) -> bool:
    """``true``/``false`` (and ``yes``/``no``, ``1``/``0``, any case), as TRL's ``string_to_bool`` reads them."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def spellings(name: str) -> list[str]:
    """``--snake_case`` first, then ``--kebab-case`` when the name has an underscore."""
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def add_switch(parser: Any, name: str, *, help: str, default: Optional[bool] = False, dest: Optional[str] = None) -> Any:
    """A bool option: present means true; ``true``/``false`` may follow (``--name=false`` too)."""
    return parser.add_argument(*spellings(name), dest=dest or name, nargs="?", const=True, default=default,
                               type=bool_value, metavar="true|false", help=help)


def _is_bool_word(text: str) -> bool:
    return text.strip().lower() in TRUE_WORDS + FALSE_WORDS


def _option_of(token: str) -> str:
    return token.split("=", 1)[0]


def unknown_option(token: str, parser: argparse.ArgumentParser, prog: str) -> Optional[str]:
    """The one-line refusal of ``token`` if it is an option ``parser`` does not know, else None."""
    option = _option_of(token)
    known = [s for s in parser._option_string_actions if s.startswith("--")]  # noqa: SLF001 - argparse's own table
    if option in parser._option_string_actions:  # noqa: SLF001
        return None
    hint = did_you_mean(option, known)
    return f"{prog}: unknown option {option}" + (f" ({hint})" if hint else "") + f"; see {prog} --help"


def _switch_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if a.nargs == "?" and a.const is True  # noqa: SLF001
            for s in a.option_strings}


def normalise_switches(argv: Sequence[str], parser: argparse.ArgumentParser, prog: str,
                       stop_at: Iterable[str] = ()) -> tuple[list[str], Optional[str]]:
    """``argv`` with every switch written ``--name=value``, up to the first positional (or a ``stop_at`` option).

    Returns ``(argv, refusal)``: ``refusal`` is the one-line message for the first unknown option
    (None when all are known). A switch followed by a path (``--fp32_lm_head script.py``) is
    ``--fp32_lm_head=true`` then the path, never a value taken from the path.
    """
    switches = _switch_options(parser)
    stops = set(stop_at)
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in stops or token == "--" or not token.startswith("-") or token == "-":
            return out + list(argv[i:]), None
        refusal = unknown_option(token, parser, prog)
        if refusal is not None:
            return list(argv), refusal
        option = _option_of(token)
        action = parser._option_string_actions[option]  # noqa: SLF001
        if "=" in token or action.nargs == 0:
            out.append(token)
            i += 1
        elif option in switches:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and _is_bool_word(nxt):
                out.append(f"{option}={nxt}")
                i += 2
            else:
                out.append(f"{option}=true")
                i += 1
        elif action.nargs == argparse.REMAINDER:
            return out + list(argv[i:]), None
        else:  # one value each (the parsers here take no multi-value options)
            out += list(argv[i:i + 2])
            i += 2
    return out, None
