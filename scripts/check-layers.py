#!/usr/bin/env python3
"""The library's floors, as docs/layout.md lists them, hold in the code.

docs/layout.md lists the floors of `src/` top to bottom in a text block: a line that starts
with a floor's name and then a path (`ops         src/ops/ ...`), and lines below it that
start with spaces and a path (`            src/amp.rs ...`), each path a module of the crate.
This script checks, for every line of code (comments skipped) of every file under `src/`:
  - every `crate::<module>` it names, in a path or in a `use crate::{...}` group, is on the
    file's own floor or one below it: no import runs back up the floors;
  - it names nothing through the crate root (`crate::SyncBatchNorm`, `crate::Layout`): a lower
    floor imports from the module that defines the item, so the root's re-exports hide no
    edge;
and that every module of `src/` is on some floor. Prints each offence and exits 1 if any.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
FLOOR = re.compile(r"^([a-z-]+)\s+src/([a-z_]+)(?:/|\.rs)")
MORE = re.compile(r"^\s{4,}src/([a-z_]+)(?:/|\.rs)")
PATH = re.compile(r"(?<![\w$])crate::(\w+)")
GROUP = re.compile(r"(?<![\w$])crate::\{([^}]*)\}", re.S)


def floors() -> dict[str, int]:
    """Module → floor number (0 the top), from docs/layout.md."""
    out: dict[str, int] = {}
    names: list[str] = []
    for line in (ROOT / "docs" / "layout.md").read_text(encoding="utf-8").splitlines():
        m = FLOOR.match(line)
        if m:
            names.append(m.group(1))
            out[m.group(2)] = len(names) - 1
            continue
        m = MORE.match(line)
        if m and names:
            out[m.group(1)] = len(names) - 1
    return out


def code_of(path: pathlib.Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join(l.split("//")[0] if "\"" not in l else l for l in lines if not l.lstrip().startswith("//"))


def main() -> int:
    floor = floors()
    modules = {p.stem if p.suffix == ".rs" else p.name for p in SRC.iterdir() if p.name != "lib.rs"}
    bad = [f"docs/layout.md places no floor for src/{m}" for m in sorted(modules - floor.keys())]
    bad += [f"docs/layout.md places src/{m}, which does not exist" for m in sorted(floor.keys() - modules)]
    edges = 0
    for path in sorted(SRC.rglob("*.rs")):
        rel = path.relative_to(SRC)
        if rel.parts == ("lib.rs",):
            continue
        here = rel.parts[0].removesuffix(".rs")
        code = code_of(path)
        named = [m.group(1) for m in PATH.finditer(code)]
        for g in GROUP.finditer(code):
            named += re.findall(r"(?:^|,)\s*(\w+)", g.group(1))
        for name in sorted(set(named)):
            if name == here:
                continue
            if name not in modules:
                bad.append(f"src/{rel}: crate::{name} reaches through the crate root; import it from its module")
            elif here in floor and name in floor:
                edges += 1
                if floor[name] < floor[here]:
                    bad.append(f"src/{rel}: imports crate::{name}, a floor above {here}")
    for b in bad:
        print("FAIL:", b)
    print(f"{len(floor)} modules on {len(set(floor.values()))} floors, {edges} imports between modules checked, {len(bad)} offences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
