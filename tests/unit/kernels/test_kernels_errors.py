"""Errors the kernels give a user: every C++ check has a message, and an id outside its
table is named by feature in backward as it is in forward."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

CSRC = Path(__file__).resolve().parents[3] / "tetrarec" / "kernels" / "csrc"
CHECK_MACROS = re.compile(
    r"\b(TETRAREC_CHECK|TORCH_CHECK\w*|TORCH_INTERNAL_ASSERT\w*|AT_ASSERT\w*)\s*\("
)


def _macro_args(text: str, open_paren: int) -> list[str]:
    """The top-level comma-separated arguments of the call whose "(" is at open_paren."""
    args, depth, start, i, in_str = [], 0, open_paren + 1, open_paren, False
    while True:
        c = text[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return args
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1


def _checks() -> list[tuple[str, int, str, list[str]]]:
    found = []
    for path in sorted(CSRC.glob("*.[ch]*")):
        text = path.read_text()
        for m in CHECK_MACROS.finditer(text):
            if text[: m.start()].rstrip().endswith("#define"):
                continue  # the macro's own definition (check.h)
            line = text.count("\n", 0, m.start()) + 1
            found.append((path.name, line, m.group(1), _macro_args(text, m.end() - 1)))
    return found


def test_every_cpp_check_carries_a_message() -> None:
    """A bare ``TORCH_CHECK(cond)`` (four were) tells the user only the condition's C++
    text; each check must say what is wrong in words, starting with a string literal."""
    checks = _checks()
    assert len(checks) >= 20, "the scan found too few checks: is the parser broken?"
    bare = [
        f"{name}:{line}: {macro}({args[0]})"
        for name, line, macro, args in checks
        if len(args) < 2 or not args[1].startswith('"')
    ]
    assert not bare, "checks without a message:\n" + "\n".join(bare)


def test_cpp_checks_raise_through_tetrarec_check_not_torch_check() -> None:
    """A ``TORCH_CHECK`` with a formatted message crashed the process (segmentation fault)
    instead of raising, on an H200 machine's torch 2.11.0+cu130 built with g++ 13.3 (a
    five-line extension did the same); ``TETRAREC_CHECK`` (csrc/check.h) throws a
    ``std::runtime_error`` that reaches Python there too."""
    torch_checks = [
        f"{name}:{line}" for name, line, macro, _ in _checks() if macro != "TETRAREC_CHECK"
    ]
    assert not torch_checks, f"use TETRAREC_CHECK: {torch_checks}"


TABLES = [
    TableConfig(name="a", num_embeddings=7, dim=4),
    TableConfig(name="b", num_embeddings=5, dim=4, feature_names=("b_click", "b_view")),
    TableConfig(name="c", num_embeddings=9, dim=4),
]


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.INT8])
def test_backward_names_the_feature_of_an_id_outside_its_table(kernel_path, precision) -> None:
    """With ``check_bounds=False`` the forward does not check, and backward must not
    update a wrong row: it raised "id -1 outside table of 5 rows" (compiled, no feature)
    or silently updated row 4 of table b (portable: negative index). Now both paths
    raise the forward's ValueError naming the feature, before touching any row."""
    tables = [dataclasses.replace(t, precision=Precision.parse(precision)) for t in TABLES]
    ebc = FusedEmbeddingBagCollection(
        tables, SparseOptimizerSpec(kind="sgd", lr=0.1), check_bounds=False, seed=0
    )
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    # -1 in b_view: a table in the middle of the store, so the unchecked compiled forward
    # reads the previous table's last row (memory it owns), not outside the storage.
    sf = SparseFeatures.from_lists(
        {"a": [[1], [2]], "b_click": [[0], [4]], "b_view": [[3], [-1, 2]], "c": [[8], []]}
    )
    out = ebc(sf).values
    with pytest.raises(
        ValueError, match=r"feature 'b_view': id -1 is outside its table 'b' of 5 rows"
    ) as info:
        out.sum().backward()
    assert "backward" in str(info.value)
    after = ebc.state_dict()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"{name} changed by a failed backward"


def test_backward_kernel_message_gives_the_feature_index(kernel_path) -> None:
    """The op itself (no module to name the feature) gives the feature's index."""
    ebc = FusedEmbeddingBagCollection(
        TABLES, SparseOptimizerSpec(kind="sgd", lr=0.1), check_bounds=False, seed=0
    )
    sf = SparseFeatures.from_lists(
        {"a": [[1], [2]], "b_click": [[0], [4]], "b_view": [[3], [7]], "c": [[8], []]}
    )
    from tetrarec.kernels import ops

    store = 0
    meta, offs = ebc._cached_meta(store)
    grad = torch.ones(2, 16)
    with pytest.raises(RuntimeError, match=r"feature 2 .*: id 7 is outside its table of 5 rows"):
        ops.tbe_backward_update(
            grad, ebc._storage(store), meta, sf.values, sf.lengths, None, ebc._states(store),
            offs, "sgd", [0.1, 1e-8, 0.9, 0.999, 0.0], "fp32", [0, 0, 0, 1, 0],
        )  # fmt: skip


def _op_batch() -> tuple[FusedEmbeddingBagCollection, SparseFeatures]:
    ebc = FusedEmbeddingBagCollection(TABLES, SparseOptimizerSpec(kind="sgd", lr=0.1), seed=0)
    sf = SparseFeatures.from_lists(
        {"a": [[1], [2]], "b_click": [[0], [4]], "b_view": [[3], [1, 2]], "c": [[8], []]}
    )
    return ebc, sf


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("narrow", "grad_out has 15 columns, the features need 16"),
        ("few_values", "the lengths add up to 8 ids, values holds 7"),
        ("few_weights", "the lengths add up to 8 ids, the per-id weights hold 7"),
        ("batch", "lengths must have F*B = 4*3 entries, got 8"),
    ],
)
def test_a_batch_off_the_layout_is_refused_before_any_read(
    kernel_path, case: str, message: str
) -> None:
    """A gradient narrower than the store's columns, lengths that add up to more ids than
    ``values`` (or the per-id weights) holds, or lengths of another batch size: the
    compiled backward read past those buffers' ends (a wrong update or a crash, no error)
    and the portable one failed deep inside with a shape error. Both refuse it first,
    with the same message, and no row changes."""
    from tetrarec.kernels import ops

    ebc, sf = _op_batch()
    meta, offs = ebc._cached_meta(0)
    grad, values, psw = torch.ones(2, 16), sf.values, None
    if case == "narrow":
        grad = torch.ones(2, 15)
    elif case == "few_values":
        values = sf.values[:-1]
    elif case == "few_weights":
        psw = torch.ones(sf.values.numel() - 1)
    else:
        grad = torch.ones(3, 16)
    before = ebc._storage(0).clone()
    with pytest.raises(RuntimeError, match=re.escape(f"tetrarec tbe backward: {message}")):
        ops.tbe_backward_update(
            grad, ebc._storage(0), meta, values, sf.lengths, psw, ebc._states(0),
            offs, "sgd", [0.1, 1e-8, 0.9, 0.999, 0.0], "fp32", [0, 0, 0, 1, 0],
        )  # fmt: skip
    assert torch.equal(ebc._storage(0), before)


def test_an_output_narrower_than_the_layout_is_refused(kernel_path) -> None:
    """The forward writes each feature's columns of ``out``: one narrower than the store's
    columns was written past its end (compiled). Both paths refuse it, naming both
    widths."""
    from tetrarec.kernels import ops

    ebc, sf = _op_batch()
    meta, _ = ebc._cached_meta(0)
    out = torch.zeros(2, 12)
    with pytest.raises(
        RuntimeError,
        match=re.escape("tetrarec tbe forward: out has 12 columns, the features need 16"),
    ):
        ops.tbe_forward(ebc._storage(0), meta, sf.values, sf.lengths, None, out, "fp32", True)
