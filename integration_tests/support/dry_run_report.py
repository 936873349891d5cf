"""Reading ``rollout-parity launch --dry-run``'s printed report back (its sections and their JSON values)."""

from __future__ import annotations

import json
import re


def sections(text: str) -> dict[str, dict[str, str]]:
    """The report's sections: each header line (its words before ' (' or ':') -> {key: value text}."""
    out: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith("  "):
            current = out.setdefault(re.split(r" \(|:", line, maxsplit=1)[0], {})
        elif current is not None:
            key, _, value = line.strip().partition(": ")
            current[key] = value
    return out


def json_items(section: dict[str, str]) -> dict:
    """A section's values, each read as JSON (a trailing ``  (note)`` dropped)."""
    return {k: json.loads(v.split("  (", 1)[0]) for k, v in section.items() if k != "sampler-aware pi_old"}
