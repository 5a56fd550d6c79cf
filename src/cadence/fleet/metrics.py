"""A fleet's /metrics: the replicas' Prometheus expositions merged into one, with the same names
as a single server's.

Counters and histograms (buckets, sums, counts) add up over the replicas. Gauges appear once per
replica with a `replica` label and once summed without it. The ingress's own exposition (the
refusals it answers) is added in as one more source of counters; its gauges are not the fleet's
and are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

Labels = tuple[tuple[str, str], ...]


@dataclass
class _Family:
    type: str
    help: str
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)


def merge_expositions(local: str, replicas: Mapping[str, str]) -> str:
    """One exposition from the ingress's (`local`) and each replica's, by replica name."""
    families: dict[str, _Family] = {}
    for source, text in [("", local), *replicas.items()]:
        for fam in text_string_to_metric_families(text):
            if fam.type == "gauge" and not source:
                continue
            merged = families.setdefault(fam.name, _Family(fam.type, fam.documentation))
            for s in fam.samples:
                labels = tuple(sorted(s.labels.items()))
                key = (s.name, labels)
                merged.samples[key] = merged.samples.get(key, 0.0) + s.value
                if fam.type == "gauge":
                    merged.samples[(s.name, (*labels, ("replica", source)))] = s.value
    return _render(families)


def _render(families: dict[str, _Family]) -> str:
    lines = []
    for name, fam in families.items():
        lines.append(f"# HELP {name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {name} {fam.type}")
        for (sample, labels), value in fam.samples.items():
            lines.append(f"{sample}{_labels(labels)} {floatToGoString(value)}")
    return "\n".join(lines) + "\n"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in labels) + "}"


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n")
