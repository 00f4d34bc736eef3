#!/usr/bin/env python3
"""Every test the documentation cites must exist.

Scans the README, the other Markdown documents and the library's doc comments (`//!` and `///`
lines under `src/`) for two forms of test reference:
  - `tests/<file>.rs::<name>` (or `tests/<dir>/<file>.rs::<module>::<name>`): the file must
    exist and define `fn <name>` (or, under a module such as `cpu::` that a macro generates,
    name it as a whole word);
  - `<module path>::tests::<name>` (a unit test in `src/`): some file of that module path under
    `src/` (`a/b.rs`, `a/b/mod.rs`, `a/b/tests.rs`, at any depth) must define `fn <name>`; a
    path that starts with `candle_rendezvous::` or `candle_collective::` is looked up under that
    crate's `src/`.
A `*` as the name accepts any test of the module. Prints each reference that does not resolve
and exits 1 if there is one.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted(
    p
    for d in ("docs", "examples", "gpu-sim", "scripts", "candle-rendezvous", "candle-collective")
    for p in (ROOT / d).rglob("*.md")
)
CRATES = {"candle_rendezvous": "candle-rendezvous", "candle_collective": "candle-collective"}
SOURCES = sorted((ROOT / "src").rglob("*.rs")) + sorted(
    p for d in CRATES.values() for p in (ROOT / d / "src").rglob("*.rs")
)
INTEGRATION = re.compile(r"tests/([A-Za-z0-9_/]+\.rs)((?:::[A-Za-z0-9_*]+)+)")
UNIT = re.compile(r"\b((?:[a-z_][a-z0-9_]*::)+)tests::([A-Za-z0-9_*]+)")


def defines(path: pathlib.Path, name: str, loose: bool) -> bool:
    if name == "*":
        return True
    text = path.read_text(encoding="utf-8")
    if re.search(rf"\bfn {re.escape(name)}\b", text):
        return True
    return loose and re.search(rf"\b{re.escape(name)}\b", text) is not None


def unit_files(modules: list[str]) -> list[pathlib.Path]:
    base = ROOT / "src"
    if modules[0] in CRATES:
        base, modules = ROOT / CRATES[modules[0]] / "src", modules[1:]
        if not modules:
            return [base / "lib.rs", base / "tests.rs"]
    stem = "/".join(modules)
    out = []
    for pattern in (f"{stem}.rs", f"{stem}/mod.rs", f"{stem}/tests.rs"):
        out += base.glob(pattern)
        out += base.glob(f"**/{pattern}")
    return sorted(set(out))


def main() -> int:
    bad = []
    checked = 0
    for doc in DOCS + SOURCES:
        if not doc.exists():
            continue
        rel = doc.relative_to(ROOT)
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if doc.suffix == ".rs" and not line.lstrip().startswith(("//!", "///")):
                continue
            for m in INTEGRATION.finditer(line):
                checked += 1
                file, segments = ROOT / "tests" / m.group(1), m.group(2).split("::")[1:]
                if not file.exists():
                    bad.append(f"{rel}:{n}: tests/{m.group(1)} does not exist")
                elif not defines(file, segments[-1], loose=len(segments) > 1):
                    bad.append(f"{rel}:{n}: tests/{m.group(1)} has no test {m.group(2)[2:]}")
            for m in UNIT.finditer(line):
                checked += 1
                modules = m.group(1).rstrip(":").split("::")
                files = [f for f in unit_files(modules) if defines(f, m.group(2), loose=False)]
                if not files:
                    bad.append(f"{rel}:{n}: no unit test {m.group(0)}")
    for b in bad:
        print(b)
    print(f"{checked} test references checked, {len(bad)} unresolved")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
