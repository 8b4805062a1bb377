"""The layering rules of docs/architecture.md, checked on the source with ``ast``.

- Every module of ``elixir/`` sits on a floor of the table in docs/architecture.md (the one place
  the floors are written); a module never imports one on a higher floor (type-only imports
  included), and no two parts of the table import each other, directly or round a cycle.
- An import inside a function carries a one-line reason (a comment on its line or the line above):
  such imports are kept only for optional dependencies.
"""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir")
DOC = os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")


def floor_table() -> dict[str, int]:
    """``{part: floor}`` from the table under "## Floors" in docs/architecture.md; a part is a
    folder (``chunk/``) or a file (``cli.py``, ``profiling/calibrate.py``) relative to elixir/."""
    text = open(DOC).read()
    section = text.split("## Floors", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for part in re.findall(r"`([^`]+)`", m.group(2)):
                assert part not in table, f"{part} is listed twice in the floor table"
                table[part] = int(m.group(1))
    assert table, "no floor table under '## Floors' in docs/architecture.md"
    return table


def modules() -> dict[str, str]:
    """``{dotted name: path relative to elixir/}`` for every Python file of the package."""
    out = {}
    for dp, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), ROOT).replace(os.sep, "/")
                name = "elixir." + rel[:-3].replace("/", ".")
                out[name.removesuffix(".__init__") if f == "__init__.py" else name] = rel
    return out


def part_of(rel: str, table: dict[str, int]) -> str:
    """The most specific table entry covering the file ``rel``."""
    if rel in table:
        return rel
    parts = rel.split("/")
    for i in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:i]) + "/"
        if folder in table:
            return folder
    raise AssertionError(f"elixir/{rel} is on no floor: add it (or its folder) to the table in docs/architecture.md")


def imports(rel: str, mods: dict[str, str]):
    """``(imported file, line, inside a function, has a reason comment)`` for each import of an
    elixir module in ``rel``."""
    src = open(os.path.join(ROOT, rel)).read()
    lines = src.splitlines()
    tree = ast.parse(src)
    name = next(n for n, r in mods.items() if r == rel)
    package = name if rel.endswith("__init__.py") else name.rsplit(".", 1)[0]
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        line = lines[node.lineno - 1]
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        reason = "#" in line or above.startswith("#")
        for t in targets:
            if t == "elixir" or t.startswith("elixir."):
                while t not in mods:
                    t = t.rsplit(".", 1)[0]
                yield mods[t], node.lineno, id(node) in in_function, reason
            elif id(node) in in_function:
                yield None, node.lineno, True, reason


def test_no_upward_imports_and_no_cycles():
    table = floor_table()
    mods = modules()
    edges: dict[str, set[str]] = {}
    upward = []
    for rel in sorted(mods.values()):
        a = part_of(rel, table)
        for target, lineno, _, _ in imports(rel, mods):
            if target is None:
                continue
            b = part_of(target, table)
            if a == b:
                continue
            edges.setdefault(a, set()).add(b)
            if table[b] > table[a]:
                upward.append(f"elixir/{rel}:{lineno} (floor {table[a]}) imports elixir/{target} (floor {table[b]})")
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)
    # cycles between parts (same-floor parts may import each other one way only)
    cycles = _cycles(edges)
    assert not cycles, "circular imports between parts:\n" + "\n".join(cycles)


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    """Each cycle of the directed graph ``edges`` found by a depth-first walk, as ``a -> b -> a``."""
    cycles: list[str] = []
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                cycles.append(" -> ".join(path[path.index(v):] + [v]))
            elif v not in state:
                visit(v, path + [v])
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u, [u])
    return cycles


def test_no_two_files_import_each_other():
    """Between files too, inside one folder as across folders, type-only imports included: no circle.
    (A package's ``__init__`` re-exporting its own files is not a file importing another's code back.)"""
    mods = modules()
    edges: dict[str, set[str]] = {}
    for rel in sorted(mods.values()):
        for target, _, _, _ in imports(rel, mods):
            if target is None or target == rel:
                continue
            if rel.endswith("__init__.py") and target.startswith(rel[: -len("__init__.py")]):
                continue  # a package's facade importing its own members
            edges.setdefault(rel, set()).add(target)
    cycles = _cycles(edges)
    assert not cycles, "files that import each other (directly or round a circle):\n" + "\n".join(cycles)


def test_no_lazy_module_getattr():
    """A module-level ``__getattr__`` defers an import until first use, which hides a circle or an
    upward import from every check above: elixir has none."""
    found = []
    for rel in sorted(modules().values()):
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        found += [f"elixir/{rel}:{n.lineno}" for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    assert not found, "module-level __getattr__ (import at the top instead):\n" + "\n".join(found)


def test_function_level_imports_give_a_reason():
    mods = modules()
    silent = [
        f"elixir/{rel}:{lineno}"
        for rel in sorted(mods.values())
        for _, lineno, in_function, reason in imports(rel, mods)
        if in_function and not reason
    ]
    assert not silent, ("imports inside functions without a one-line reason (import at the top, or say "
                        "which optional dependency the import avoids):\n" + "\n".join(silent))


def test_every_module_is_on_a_floor():
    table = floor_table()
    for rel in modules().values():
        part_of(rel, table)
    for part in table:
        assert os.path.exists(os.path.join(ROOT, part)), f"the floor table names elixir/{part}, which does not exist"


# Private names of *other* projects that elixir reads, each with the reason no public API serves.
# Elixir's own private names are never read from another module: a file reads only the private
# names it defines itself (through ``self``/``cls`` or otherwise).
FOREIGN_PRIVATE = {
    "_parameters": "torch.nn.Module: a module's direct parameters including None entries (no public view)",
    "_buffers": "torch.nn.Module: a module's direct buffers including None entries (no public view)",
    "_checkpoint_without_reentrant_generator": "torch.utils.checkpoint: the tracer follows non-reentrant recomputation",
    "_schema": "torch OpOverload: the op's schema tells which arguments it mutates (no public accessor)",
    "_pytree": "torch.utils._pytree: flattening op arguments, as torch's own dispatch modes do",
    "_python_dispatch": "torch.utils._python_dispatch: TorchDispatchMode, the documented way to write a dispatch mode",
    "_scaled_dot_product_flash_attention_for_cpu": "an aten op whose name starts with an underscore",
    "_grouped_mm": "an aten op whose name starts with an underscore (the MoE grouped matmul the tracer shapes)",
    "_actions": "argparse: the subparser action, to add a subcommand's arguments lazily",
    "_opt_called": "torch.optim.Optimizer: set by step() to silence the LR scheduler's order warning",
    "_C": "torch._C / elixir._C: compiled extension modules",
    "_native": "elixir._native: the module that is the one door to the C++ extension",
    "_cdata": "torch storage identity (no public equivalent on UntypedStorage)",
    "_exit": "os._exit: leave a rank without finalizing the interpreter (see elixir/launch.py)",
    "_shutdown": "threading._shutdown: join non-daemon threads as interpreter exit does (elixir/launch.py)",
    "_run_exitfuncs": "atexit._run_exitfuncs: run the exit handlers before os._exit (elixir/launch.py)",
    "_IncompatibleKeys": "torch.nn.Module.load_state_dict's return type, returned the same way",
    "_dynamo": "torch._dynamo: excluding hooks from compilation",
    "_elixir_routed": "a marker attribute elixir sets on a Lightning function it wraps",
    "_SubParsersAction": "argparse: the type of the subcommands action",
    "_AcceleratorConnector": "Lightning: the connector whose precision choice elixir routes",
    "_fused_adamw_": "aten's fused AdamW kernel, called directly for the CPU fallback",
    "_fused_adam_": "aten's fused Adam kernel, called directly for the CPU fallback",
    "_current_graph_task_id": "torch autograd: which backward pass is running (no public accessor)",
    "_dispatch_has_kernel_for_dispatch_key": "torch._C: whether an op has a Meta kernel",
    "_is_mkldnn_bf16_supported": "torch.ops.mkldnn: whether torch has a native bf16 GEMM on this CPU (elixir/lowp_gemm.py)",
    "_is_mkldnn_fp16_supported": "torch.ops.mkldnn: whether torch has a native fp16 GEMM on this CPU (elixir/lowp_gemm.py)",
    "_fused_sdp_choice": "aten: which attention kernel CPU picks, so the tracer counts the same one",
    "_execution_engine": "torch autograd: queue_callback at the end of backward, as FSDP does",
    "_is_key_in_tls": "torch._C thread-local state: Python objects taken out while a collective is issued",
    "_get_obj_in_tls": "torch._C thread-local state (see elixir/distributed.py)",
    "_remove_obj_from_tls": "torch._C thread-local state (see elixir/distributed.py)",
    "_stash_obj_in_tls": "torch._C thread-local state (see elixir/distributed.py)",
    "_init_weights": "transformers PreTrainedModel: the per-module initialiser post_init runs (wrapper/materialize.py)",
}


def _private_names_defined(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[-1])
    return {n for n in out if n.startswith("_")}


def test_no_module_reads_another_modules_private_names():
    mods = modules()
    found = []
    for rel in sorted(mods.values()):
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        own = _private_names_defined(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or node.attr in FOREIGN_PRIVATE:
                continue
            found.append(f"elixir/{rel}:{node.lineno}: .{node.attr}")
    assert not found, ("private names read across modules (make them public, or add a foreign one to "
                       "FOREIGN_PRIVATE with the reason):\n" + "\n".join(found))


def test_readme_layout_lists_every_folder():
    readme = open(os.path.join(os.path.dirname(ROOT), "README.md")).read()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`elixir/([\w]+)/`", layout))
    folders = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)) and d != "__pycache__"}
    assert listed == folders, f"README's layout table: missing {sorted(folders - listed)}, stale {sorted(listed - folders)}"
