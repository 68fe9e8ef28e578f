#!/usr/bin/env python3
"""Checks that burn-slidesparse's modules import only from layers below their own.

The layer table is the one in docs/architecture.md (section "Layers"): each row names a
layer number and the modules in it. A module that is a folder (`cuda/cusparselt/`) counts
with everything inside it. The script reads every module's `use crate::...`, `use super::...`
and in-code `crate::a::b` / `super::a` paths (tests excluded: a `#[cfg(test)] mod tests`
block may use any module it checks), and fails on

- a module missing from the table, or a table entry that is not a module;
- an import of a module in a higher layer;
- an import cycle among modules (in any layers: within a layer imports are allowed, as long
  as they form no cycle).

It also checks that `cuda/mod.rs` lists the CUDA layers as the table does (its
`//! N. name: modules` lines), so the two cannot drift.

Usage: scripts/check-layers.py [--graph]   (--graph prints each module's imports)
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
    declarations (and `cuda/mod.rs`'s `internal_modules!` list); the crate root is `crate`.
    Files that no declaration reaches are not modules and are not read."""
    found = {}

    def visit(name, path):
        found[name] = path
        code = code_of(path, keep_tests=True)
        declared = re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", code, re.M)
        for listed in re.findall(r"internal_modules!\s*\(([^)]*)\)", code):
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
        for m in re.finditer(r"\buse\s+([^;]+);", code):
            for segments in use_paths(m.group(1)):
                target = absolute(segments)
                if target is not None:
                    found.add(resolve(target))
        for m in re.finditer(r"(?<![\w:$])((?:crate|super|self)(?:::\w+)+)", code):
            if m.group(1).startswith(("self::", "super::")) and "use " in code[max(0, m.start() - 200) : m.start()].split(";")[-1]:
                continue  # inside a `use` statement: done above
            target = absolute(m.group(1).split("::"))
            if target is not None:
                found.add(resolve(target))

    scan(code_of(path), file_module, is_folder)
    found.discard(module)
    # A module may name its own descendants (a folder's `mod.rs` declares them).
    return {f for f in found if not f.startswith(module + "::") or module == "crate"}


def layer_table():
    """`module -> (layer number, layer name)` from docs/architecture.md's "Layers" table."""
    text = open(TABLE, encoding="utf-8").read()
    m = re.search(r"^## Layers\n(.*?)(?=^## )", text, re.S | re.M)
    if not m:
        sys.exit(f"{TABLE}: no '## Layers' section")
    table = {}
    for line in m.group(1).splitlines():
        row = re.match(r"\|\s*(\d+)\.\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|", line)
        if not row:
            continue
        number, name = int(row.group(1)), row.group(2)
        for module in re.findall(r"`([\w:]+)`", row.group(3)):
            if module in table:
                sys.exit(f"{TABLE}: `{module}` is in two layers")
            table[module] = (number, name)
    if not table:
        sys.exit(f"{TABLE}: the '## Layers' table has no rows")
    return table


def unit_of(module, table):
    """The table entry a module belongs to: itself, or the folder module holding it."""
    segments = module.split("::")
    for n in range(len(segments), 0, -1):
        name = "::".join(segments[:n])
        if name in table:
            return name
    return None


def cuda_mod_layers():
    """`cuda/mod.rs`'s list: `//! N. name: modules` lines -> {module: number}."""
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


def main():
    known = modules()
    table = layer_table()
    errors = []
    for entry in sorted(table):
        if entry not in known and not any(k.startswith(entry + "::") for k in known):
            errors.append(f"docs/architecture.md lists `{entry}`, which is not a module")
    graph, units = {}, {}
    for module, path in sorted(known.items()):
        if module == "crate":
            continue  # lib.rs declares and re-exports everything: it is the top
        unit = unit_of(module, table)
        if unit is None:
            errors.append(f"`{module}` ({os.path.relpath(path, ROOT)}) is in no layer of docs/architecture.md")
            continue
        units[module] = unit
    if "--graph" in sys.argv:
        for module in sorted(units):
            deps = sorted(imports(module, known[module], known) - {"crate"})
            print(f"{module} [{table[units[module]][0]}] -> {' '.join(deps)}")
    for module in sorted(units):
        unit = units[module]
        layer = table[unit][0]
        for dep in sorted(imports(module, known[module], known)):
            if dep == "crate":
                errors.append(f"`{module}` imports the crate root (import from the module itself)")
                continue
            dep_unit = units.get(dep)
            if dep_unit is None or dep_unit == unit:
                continue
            graph.setdefault(unit, set()).add(dep_unit)
            dep_layer = table[dep_unit][0]
            if dep_layer > layer:
                errors.append(
                    f"`{module}` (layer {layer}, {table[unit][1]}) imports `{dep}` "
                    f"(layer {dep_layer}, {table[dep_unit][1]}): upward"
                )
    for cycle in cycles(graph):
        errors.append("import cycle among " + ", ".join(f"`{m}`" for m in cycle))
    listed = cuda_mod_layers()
    in_table = {m: n for m, (n, _) in table.items() if m.startswith("cuda::")}
    if listed != in_table:
        for m in sorted(set(listed) | set(in_table)):
            a, b = listed.get(m), in_table.get(m)
            if a != b:
                errors.append(
                    f"`{m}`: layer {a} in burn-slidesparse/src/cuda/mod.rs, {b} in docs/architecture.md"
                )
    if errors:
        print("check-layers: " + str(len(errors)) + " problem(s)", file=sys.stderr)
        for e in errors:
            print("  " + e, file=sys.stderr)
        sys.exit(1)
    print(f"check-layers: {len(units)} modules in {len(set(n for n, _ in table.values()))} layers, no upward import, no cycle")


if __name__ == "__main__":
    main()
