"""Pool the paired ratios of several runs of one benchmark (issue 34's figure table).

Every ratio in the inputs is already paired inside one run (a repetition of a mode against the same repetition
of its reference, or a pair of ours and fio); pooling the ratios of two such runs keeps that pairing.

    python benchmarks/figures/figures34_pool.py resilience A.json B.json
    python benchmarks/figures/figures34_pool.py paired A.json [B.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys


def _line(what: str, ratios: list[float]) -> str:
    return (
        f"{what}: median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)}: "
        + ", ".join(f"{x:.3f}" for x in ratios)
    )


def resilience(paths: list[str]) -> None:
    pooled: dict[tuple[str, str], list[float]] = {}
    takeover: list[float] = []
    for path in paths:
        doc = json.load(open(path))
        for mode, refs in doc["paired"].items():
            for ref, v in refs.items():
                pooled.setdefault((mode, ref), []).extend(v["ratios"])
        for run in doc["runs"].get("recover-standby", []):
            if run.get("median_takeover_commit_s") is not None:
                takeover.append(run["median_takeover_commit_s"])
    for (mode, ref), ratios in pooled.items():
        print(_line(f"{mode} / {ref}", ratios))
    if takeover:
        print(_line("recover-standby kill -> standby in a commit, per-run median s", takeover))


def paired(paths: list[str]) -> None:
    pooled: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        doc = json.load(open(path))
        for rec in doc["records"]:
            for kind in ("save", "load"):
                s = (rec.get("summary") or {}).get(kind)
                if not s:
                    continue
                pooled.setdefault((rec["method"], f"{kind} / fio wall, best depth per pair"), []).extend(s["ratios"])
                if s.get("vs_fio_runtime"):
                    pooled.setdefault((rec["method"], f"{kind} / fio runtime, best depth per pair"), []).extend(
                        s["vs_fio_runtime"]["ratios"]
                    )
    for (method, what), ratios in pooled.items():
        print(_line(f"{method} {what}", ratios))


if __name__ == "__main__":
    {"resilience": resilience, "paired": paired}[sys.argv[1]](sys.argv[2:])
