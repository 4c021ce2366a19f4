"""The programmatic-dependent-launch contract of `kernels/cuda/launch.py`, read from the source: every host-launched
Triton kernel (`@fast_kernel`) takes `PDL: tl.constexpr = False` and calls `wait_for_inputs(PDL)` in its top-level
body before it stores, runs an atomic, or calls anything that might (a helper `@triton.jit` function). Before the
wait a kernel may only compute indices and load (the one-row GEMV loads its first weight step there). A kernel
that broke this could read a previous kernel's output before it is written, or write what that kernel still reads,
and only on a Hopper GPU under load: so it is checked here, on every machine.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / 'lmdeploy' / 'pytorch' / 'kernels' / 'cuda'
# tl calls a kernel may make before the wait: index arithmetic and loads, nothing that writes
PRE_WAIT_TL = {'program_id', 'num_programs', 'arange', 'load', 'zeros', 'full', 'where', 'cdiv', 'minimum',
               'maximum', 'multiple_of', 'max_contiguous'}


def _is_fast_kernel(node: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == 'fast_kernel' for d in node.decorator_list)


def _fast_kernels() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(KERNELS.glob('*.py')):
        tree = ast.parse(path.read_text())
        found += [(f'{path.name}::{n.name}', n) for n in tree.body if isinstance(n, ast.FunctionDef)
                  and _is_fast_kernel(n)]
    return found


def _is_wait(stmt: ast.stmt) -> bool:
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == 'wait_for_inputs'
            and [ast.unparse(a) for a in call.args] == ['PDL'])


def _pre_wait_violations(stmt: ast.stmt) -> list[str]:
    """Calls in `stmt` other than `tl.<load or index op>`, `.to(...)` and builtins on values."""
    bad = []
    for node in ast.walk(stmt):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == 'tl':
            if func.attr not in PRE_WAIT_TL:
                bad.append(ast.unparse(node))
        elif isinstance(func, ast.Attribute) and func.attr == 'to':
            continue
        else:
            bad.append(ast.unparse(node))
    return bad


KERNEL_DEFS = _fast_kernels()


def test_every_fast_kernel_is_found():
    # the launch module's kernels are spread over many files; an empty list would make the test below vacuous
    assert len(KERNEL_DEFS) >= 25, [name for name, _ in KERNEL_DEFS]


@pytest.mark.parametrize('name,node', KERNEL_DEFS, ids=[name for name, _ in KERNEL_DEFS])
def test_fast_kernel_waits_before_it_writes(name: str, node: ast.FunctionDef):
    args = node.args
    assert args.args[-1].arg == 'PDL', f'{name}: PDL must be the last parameter'
    assert ast.unparse(args.args[-1].annotation) == 'tl.constexpr'
    assert ast.unparse(args.defaults[-1]) == 'False', f'{name}: PDL must default to False (plain launches)'
    body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
        else node.body
    waits = [i for i, stmt in enumerate(body) if _is_wait(stmt)]
    assert len(waits) == 1, f'{name}: one top-level wait_for_inputs(PDL), found {len(waits)}'
    for stmt in body[:waits[0]]:
        assert isinstance(stmt, ast.Assign | ast.AugAssign | ast.If), f'{name}: {ast.unparse(stmt)} before the wait'
        bad = _pre_wait_violations(stmt)
        assert not bad, f'{name}: {bad} before the wait'
