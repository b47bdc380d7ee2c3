"""Pass/fail/skip counts of the CUDA-marked tests, per area, for scripts/gpu_session.sh.

    python tools/cuda_test_counts.py JUNIT_XML [--json PATH]       (after pytest --junitxml)
    python tools/cuda_test_counts.py --collected PYTEST_OUTPUT       (after pytest --collect-only -q)

Areas are the issue's: precision-aware state, CUDA graph, verify mode, Lion, overlap-with-step, and the
rest of the kernels; a test counts in the first area whose words its file or name holds."""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import xml.etree.ElementTree as ET

AREAS = (("precision", ("precision",)), ("graph", ("graph",)), ("verify", ("verify",)), ("lion", ("lion",)),
         ("overlap_with_step", ("overlap_with_step",)), ("other", ("",)))


def area(test_id: str) -> str:
    low = test_id.lower()
    return next(name for name, words in AREAS if any(w in low for w in words))


def from_junit(path: str) -> dict:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failed = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        counts[area(test_id)][outcome] += 1
        if outcome in ("failed", "error"):
            failed.append(test_id)
    return {"areas": {k: dict(v) for k, v in counts.items()}, "failed": failed}


def from_collected(path: str) -> dict:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path, errors="replace") as f:
        for line in f:
            if re.match(r"^tests/\S+::\S", line):
                counts[area(line.strip())]["collected"] += 1
    return {"areas": {k: dict(v) for k, v in counts.items()}, "failed": []}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a --junitxml file, or with --collected the output of --collect-only -q")
    p.add_argument("--collected", action="store_true")
    p.add_argument("--json", metavar="PATH")
    opts = p.parse_args()
    result = from_collected(opts.source) if opts.collected else from_junit(opts.source)
    totals = collections.Counter()
    for name, c in sorted(result["areas"].items()):
        totals.update(c)
        print(f"  {name:<18} " + "  ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print(f"  {'all':<18} " + "  ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    result["totals"] = dict(totals)
    for test_id in result["failed"][:40]:
        print("  FAILED", test_id)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
