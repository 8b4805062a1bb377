"""The demo's corpus: deterministic, split by file, batches agree across ranks."""

import pytest
import torch

from elixir.data import VOCAB_SIZE, corpus_files, eval_batches, load_corpus, sample_batch, stdlib_root


def _write_tree(root, files: dict) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_files_are_sorted_and_skip_tests_and_packages(tmp_path):
    _write_tree(tmp_path, {
        "b.py": "b", "a.py": "a", "pkg/c.py": "c", "notes.txt": "x",
        "test/t.py": "t", "site-packages/s.py": "s", "pkg/tests/u.py": "u",
    })
    names = [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)]
    assert names == ["a.py", "b.py", "pkg/c.py"]


def test_split_by_file_and_byte_cap(tmp_path):
    _write_tree(tmp_path, {f"f{i:02d}.py": chr(ord("a") + i) * 10 for i in range(10)})
    c = load_corpus(max_bytes=10_000, val_every=3, root=tmp_path)
    # files 2, 5, 8 (every third) are held out; the rest train, in order
    assert bytes(c.val.tolist()) == b"c" * 10 + b"f" * 10 + b"i" * 10
    assert bytes(c.train.tolist()) == b"".join(ch.encode() * 10 for ch in "abdegh") + b"j" * 10
    assert (c.train_files, c.val_files) == (7, 3)
    capped = load_corpus(max_bytes=35, val_every=3, root=tmp_path)
    assert capped.train.numel() + capped.val.numel() == 35
    assert bytes(capped.val.tolist()) == b"c" * 10
    with pytest.raises(ValueError, match="raise max_bytes"):
        load_corpus(max_bytes=15, val_every=3, root=tmp_path)


def test_stdlib_corpus_is_real_python_and_deterministic():
    a = load_corpus(max_bytes=1_000_000)
    b = load_corpus(max_bytes=1_000_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.dtype == torch.uint8 and a.vocab_size == VOCAB_SIZE
    assert a.train.numel() + a.val.numel() == 1_000_000
    text = bytes(a.train[:200_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert a.source == str(stdlib_root())


def test_rank_slices_make_the_global_batch():
    data = torch.arange(5000) % 256
    data = data.to(torch.uint8)
    gx, gy = sample_batch(data, 8, 16, step=3, seed=1)
    parts = [sample_batch(data, 2, 16, step=3, seed=1, rank=r, world_size=4) for r in range(4)]
    # the world-4 global batch (4 ranks x 2) is exactly the world-1 batch of 8
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    # targets are inputs shifted by one byte
    assert torch.equal(gy[:, :-1], gx[:, 1:])
    assert gx.dtype == torch.int64 and gx.shape == (8, 16)
    # a different step or seed gives different windows
    assert not torch.equal(sample_batch(data, 8, 16, step=4, seed=1)[0], gx)
    assert not torch.equal(sample_batch(data, 8, 16, step=3, seed=2)[0], gx)
    with pytest.raises(ValueError, match="outside world size"):
        sample_batch(data, 2, 16, step=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="too short"):
        sample_batch(data[:10], 2, 16, step=0)


def test_eval_batches_are_fixed_and_partition_across_ranks():
    data = (torch.arange(4000) * 7 % 256).to(torch.uint8)
    one = eval_batches(data, 4, 32, 3)
    again = eval_batches(data, 4, 32, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, again))
    two = [eval_batches(data, 2, 32, 3, rank=r, world_size=2) for r in range(2)]
    for b in range(3):
        assert torch.equal(torch.cat([two[0][b][0], two[1][b][0]]), one[b][0])
        assert torch.equal(torch.cat([two[0][b][1], two[1][b][1]]), one[b][1])
