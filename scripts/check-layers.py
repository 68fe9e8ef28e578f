#!/usr/bin/env python3
"""Checks that burn-slidesparse's modules import only from their own layer or those below.

The layers are declared once, in docs/architecture.md, section "Layers": a table of the
crate's top-level modules and, under "Inside `cuda`", a table of the modules directly under
`cuda/`. A row `| N. name | `module` | ... |` opens layer N; a row with an empty first cell
adds a module to the layer above. A module with submodules (`block_ops/`, `cuda/queued/`)
counts as one, with everything inside it.

The script finds the modules from `lib.rs` through their `mod` declarations, reads each
module's `use` trees and in-code `crate::...`, `super::...`, `self::...` paths (comments,
strings and `#[cfg(test)] mod` blocks excluded: a unit test may use any module it checks),
and fails on

- a module missing from the tables, or a table entry that is not a module;
- an import of a module in a higher layer;
- an import cycle (within a layer imports are allowed, as long as they form no cycle);
- an import of the crate root or of `cuda`'s own re-exports from inside the crate;
- `cuda/mod.rs` listing the CUDA layers differently (its `//! N. name: ...` lines).

Usage: scripts/check-layers.py [--graph]   (--graph prints each module's imports first)
Only the Python standard library is used.
"""

import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SRC = os.path.join(ROOT, "burn-slidesparse", "src")
TABLE = os.path.join(ROOT, "docs", "architecture.md")
CUDA_MOD = os.path.join(SRC, "cuda", "mod.rs")


def modules():
    """Every module of the library as `a::b` -> file, found from `lib.rs` through its `mod`
    declarations (and `cuda/mod.rs`'s `internal_modules!` and `benchmark_modules!` lists);
    the crate root is `crate`.
    Files that no declaration reaches are not modules and are not read."""
    found = {}

    def visit(name, path):
        found[name] = path
        code = code_of(path, keep_tests=True)
        declared = re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", code, re.M)
        for listed in re.findall(r"(?:internal|benchmark)_modules!\s*\(([^)]*)\)", code):
            declared += re.findall(r"\w+", listed)
        folder = os.path.dirname(path)
        if os.path.basename(path) not in ("lib.rs", "mod.rs"):
            folder = os.path.join(folder, os.path.basename(path)[:-3])
        for child in declared:
            for candidate in (os.path.join(folder, child + ".rs"), os.path.join(folder, child, "mod.rs")):
                if os.path.exists(candidate):
                    visit(child if name == "crate" else name + "::" + child, candidate)
                    break

    visit("crate", os.path.join(SRC, "lib.rs"))
    return found


def code_of(path, keep_tests=False):
    """The file's code without comments and string contents, and without its unit tests
    unless `keep_tests`."""
    src = open(path, encoding="utf-8").read()
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i)
            i = n if j < 0 else j + 2
        elif src[i] == '"' and not re.match(r"[A-Za-z0-9_']", src[i - 1] if i else " "):
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""')
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    code = "".join(out)
    if keep_tests:
        return code
    # Unit tests: `#[cfg(test)]` then `mod name {`, up to its closing brace.
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", code)
        if not m:
            return code
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        code = code[: m.start()] + code[j:]


def use_paths(tree):
    """The paths a `use` tree names: `a::{b, c::d}` -> [a::b, a::c::d]."""
    tokens = re.findall(r"::|[{},*]|\w+", tree)
    pos = 0

    def parse(prefix):
        nonlocal pos
        paths, current, grouped = [], list(prefix), False
        while pos < len(tokens):
            t = tokens[pos]
            pos += 1
            if t == "{":
                paths += parse(current)
                grouped = True
            elif t == "}":
                break
            elif t == ",":
                if current != list(prefix) and not grouped:
                    paths.append(current)
                current, grouped = list(prefix), False
            elif t == "as":
                pos += 1  # the alias
            elif t not in ("::", "*", "self"):
                current = current + [t]
        if current != list(prefix) and not grouped:
            paths.append(current)
        return paths

    return parse([])


def inline_modules(code):
    """`(code outside inline modules, [(name, code of the inline module)])`, one level."""
    outside, inner, pos = [], [], 0
    for m in re.finditer(r"\bmod\s+(\w+)\s*\{", code):
        if m.start() < pos:
            continue
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        outside.append(code[pos : m.start()])
        inner.append((m.group(1), code[m.end() : j - 1]))
        pos = j
    outside.append(code[pos:])
    return "".join(outside), inner


def imports(module, path, known):
    """The modules `module` (file `path`) refers to."""
    is_folder = os.path.basename(path) in ("mod.rs", "lib.rs")
    file_module = [] if module == "crate" else module.split("::")
    found = set()

    def resolve(segments):
        for n in range(len(segments), 0, -1):
            name = "::".join(segments[:n])
            if name in known:
                return name
        return "crate"

    def scan(code, own, folder):
        # `super` is the parent of `own`; `self` is `own`.
        def absolute(segments):
            head = segments[0]
            if head == "crate":
                return segments[1:]
            if head == "super":
                base, segments = own[:-1], segments[1:]
                while segments and segments[0] == "super":
                    base, segments = base[:-1], segments[1:]
                return base + segments
            if head == "self":
                return own + segments[1:]
            # A child module named from its folder's `mod.rs` (`pub use pipeline::GpuLayer`).
            if folder and "::".join(own + [head]) in known:
                return own + segments
            return None

        code, inner = inline_modules(code)
        for name, body in inner:
            scan(body, own + [name], False)
        uses = re.compile(r"\buse\s+([^;]+);")
        for m in uses.finditer(code):
            for segments in use_paths(m.group(1)):
                target = absolute(segments)
                if target is not None:
                    found.add(resolve(target))
        # Paths in the code itself (`crate::a::f()`, `super::B`); `$crate` is a macro's.
        for m in re.finditer(r"(?<![\w:$])((?:crate|super|self)(?:::\w+)+)", uses.sub("", code)):
            target = absolute(m.group(1).split("::"))
            if target is not None:
                found.add(resolve(target))

    scan(code_of(path), file_module, is_folder)
    found.discard(module)
    # A module may name its own descendants (a folder's `mod.rs` declares them).
    return {f for f in found if not f.startswith(module + "::") or module == "crate"}


def parse_table(text, what):
    """`module -> (layer number, layer name)` from a markdown table whose rows are
    `| N. name | `module` | ... |`, or `| | `module` | ... |` for one more module of the layer
    above."""
    table, layer = {}, None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        head = re.match(r"(\d+)\.\s*(.+)", cells[0])
        if head:
            layer = (int(head.group(1)), head.group(2))
        elif cells[0] or layer is None:
            continue  # the header row, its rule, or a row before the first layer
        # The module is the cell's first code span (a feature may follow it).
        module = re.search(r"`([\w:]+)`", cells[1])
        if module:
            if module.group(1) in table:
                sys.exit(f"{TABLE}: `{module.group(1)}` is in two rows of {what}")
            table[module.group(1)] = layer
    if not table:
        sys.exit(f"{TABLE}: the table of {what} has no rows")
    return table


def layer_tables():
    """The crate's layer table (section `## Layers`) and the CUDA path's (its subsection
    `### Inside cuda`, module names relative to `cuda`)."""
    text = open(TABLE, encoding="utf-8").read()
    m = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not m:
        sys.exit(f"{TABLE}: no '## Layers' section")
    crate_part, _, cuda_part = m.group(1).partition("### Inside `cuda`")
    if not cuda_part:
        sys.exit(f"{TABLE}: no '### Inside `cuda`' subsection under '## Layers'")
    crate = parse_table(crate_part, "the crate")
    cuda = {"cuda::" + k: v for k, v in parse_table(cuda_part, "cuda").items()}
    return crate, cuda


def cuda_mod_layers():
    """`cuda/mod.rs`'s list: `//! N. name: modules` lines (every code span in them names a
    module) -> {module: number}."""
    text = open(CUDA_MOD, encoding="utf-8").read()
    listed, current = {}, None
    for line in text.splitlines():
        if not line.startswith("//!"):
            break
        body = line[3:].strip()
        m = re.match(r"(\d+)\.\s", body)
        if m:
            current = int(m.group(1))
        elif not body:
            current = None
        if current is not None:
            for module in re.findall(r"`(\w+)`", body):
                listed["cuda::" + module] = current
    return listed


def cycles(graph):
    """Every import cycle, each once (Tarjan's strongly connected components)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def check_level(name, units, table, deps, errors):
    """Layer and cycle checks among `units` (module -> its entry of `table`); `deps` maps
    each module to the entries it imports."""
    graph = {}
    for module in sorted(units):
        unit = units[module]
        layer, layer_name = table[unit]
        for dep in sorted(deps[module]):
            if dep == unit:
                continue
            graph.setdefault(unit, set()).add(dep)
            dep_layer, dep_name = table[dep]
            if dep_layer > layer:
                errors.append(
                    f"{name}: `{module}` (layer {layer}, {layer_name}) imports `{dep}` "
                    f"(layer {dep_layer}, {dep_name}): upward"
                )
    for cycle in cycles(graph):
        errors.append(f"{name}: import cycle among " + ", ".join(f"`{m}`" for m in cycle))


def main():
    known = modules()
    crate_table, cuda_table = layer_tables()
    errors = []
    imported = {m: imports(m, path, known) for m, path in known.items() if m != "crate"}
    if "--graph" in sys.argv:
        for module in sorted(imported):
            print(f"{module} -> {' '.join(sorted(imported[module]))}")
    # The crate: a module counts as its top-level module (`cuda::queued` is `cuda`).
    def top(module):
        return module.split("::")[0]

    for entry in sorted(crate_table):
        if entry not in known:
            errors.append(f"docs/architecture.md lists `{entry}`, which is not a module")
    units, deps = {}, {}
    for module, found in sorted(imported.items()):
        if top(module) not in crate_table:
            where = os.path.relpath(known[module], ROOT)
            errors.append(f"`{module}` ({where}) is in no layer of docs/architecture.md")
            continue
        units[module] = top(module)
        if "crate" in found:
            errors.append(f"`{module}` imports the crate root: import from the defining module")
        deps[module] = {top(d) for d in found if d != "crate" and top(d) in crate_table}
    check_level("crate", units, crate_table, deps, errors)
    # Inside `cuda`: a module counts as its module directly under `cuda`.
    def second(module):
        return "::".join(module.split("::")[:2])

    for entry in sorted(cuda_table):
        if entry not in known:
            errors.append(f"docs/architecture.md lists `{entry}`, which is not a module")
    units, deps = {}, {}
    for module, found in sorted(imported.items()):
        if not module.startswith("cuda::"):
            continue
        if second(module) not in cuda_table:
            errors.append(f"`{module}` is in no layer of cuda in docs/architecture.md")
            continue
        units[module] = second(module)
        if "cuda" in found:
            errors.append(
                f"`{module}` imports the `cuda` module itself (its re-exports): import from "
                "the defining module"
            )
        deps[module] = {
            second(d) for d in found if d.startswith("cuda::") and second(d) in cuda_table
        }
    check_level("cuda", units, cuda_table, deps, errors)
    listed = cuda_mod_layers()
    in_table = {m: n for m, (n, _) in cuda_table.items()}
    for m in sorted(set(listed) | set(in_table)):
        a, b = listed.get(m), in_table.get(m)
        if a != b:
            errors.append(
                f"`{m}`: layer {a} in burn-slidesparse/src/cuda/mod.rs, {b} in docs/architecture.md"
            )
    if errors:
        print(f"check-layers: {len(errors)} problem(s)", file=sys.stderr)
        for e in errors:
            print("  " + e, file=sys.stderr)
        sys.exit(1)
    crate_layers = len({n for n, _ in crate_table.values()})
    cuda_layers = len({n for n, _ in cuda_table.values()})
    print(
        f"check-layers: {len(imported)} modules, {crate_layers} layers in the crate and "
        f"{cuda_layers} in cuda: no upward import, no cycle"
    )


if __name__ == "__main__":
    main()
