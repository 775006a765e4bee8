"""NGramPool on small hand-made arrays; a property test against the pure-Python reference pool."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_pool import NGramPool, Origin
from ngram_pool.reference import PyNGramPool


@pytest.fixture(params=[False, True], ids=["dense", "sparse"])
def sparse(request):
    return request.param


def test_lookup_is_most_recent_first_and_deduplicated(sparse):
    pool = NGramPool(vocab_size=10, n=3, slots_per_key=3, sparse=sparse)
    # key 1 gets (2,3), then (4,5), then (2,3) again: the repeat is moved to the front, not stored twice
    assert pool.insert_many(np.array([[1, 2, 3], [1, 4, 5], [1, 2, 3]])) == 2
    assert pool.lookup(1).tolist() == [[2, 3], [4, 5]]
    assert pool.stats.ngrams_stored == 2 and pool.stats.keys_used == 1


def test_full_key_evicts_least_recently_used(sparse):
    pool = NGramPool(vocab_size=10, n=2, slots_per_key=2, sparse=sparse)
    pool.insert_many(np.array([[0, 1], [0, 2]]))  # key 0: [2, 1]
    pool.insert_many(np.array([[0, 1]]))  # refresh 1 -> [1, 2]; now 2 is the least recently used
    pool.insert_many(np.array([[0, 3]]))  # full: 2 falls off -> [3, 1]
    assert pool.lookup(0).tolist() == [[3], [1]]
    assert pool.lookup(0, max_candidates=1).tolist() == [[3]]


def test_empty_lookups_return_empty_arrays(sparse):
    pool = NGramPool(vocab_size=10, n=4, sparse=sparse)
    cands = pool.lookup(7)
    assert cands.shape == (0, 3) and cands.dtype == np.int32
    pool.insert_many(np.array([[7, 1, 2, 3]]))
    assert pool.lookup(7, max_candidates=0).shape == (0, 3)
    assert pool.stats.hits == 0 and pool.stats.misses == 2
    assert pool.lookup(7).shape == (1, 3) and pool.stats.hits == 1


def test_origins_follow_the_latest_insertion(sparse):
    pool = NGramPool(vocab_size=20, n=3, sparse=sparse)
    pool.insert_sequence([5, 6, 7, 5, 6, 8], origin=Origin.PROMPT)  # (5,6,7) (6,7,5) (7,5,6) (5,6,8)
    pool.insert_many(np.array([[5, 6, 7]]), origin=Origin.TRAJECTORY)  # (5,6,7) is seen again by the window
    cands, origins = pool.lookup_with_origins(5)
    assert cands.tolist() == [[6, 7], [6, 8]]
    assert origins.tolist() == [Origin.TRAJECTORY, Origin.PROMPT]


def test_insert_sequences_takes_each_sequences_windows_in_order_as_insert_many(sparse):
    # the windows of each sequence, never across two: the same pool as inserting them one batch at a time
    sequences = [[1, 2, 3, 4, 1, 2, 5], [4, 1], [2, 5, 1, 2, 3], []]
    pool, ref = NGramPool(vocab_size=8, n=3, slots_per_key=2, sparse=sparse), NGramPool(vocab_size=8, n=3, slots_per_key=2, sparse=sparse)
    new = pool.insert_sequences(sequences, origin=Origin.OUTPUT)
    windows = [seq[i : i + 3] for seq in sequences for i in range(len(seq) - 2)]
    assert new == ref.insert_many(np.array(windows), origin=Origin.OUTPUT) == 7  # 8 windows, (1,2,3) twice
    for key in range(8):
        assert [a.tolist() for a in pool.lookup_with_origins(key)] == [a.tolist() for a in ref.lookup_with_origins(key)]
    assert pool.insert_sequences([]) == 0


def test_insert_sequence_shorter_than_n_inserts_nothing():
    pool = NGramPool(vocab_size=10, n=4)
    assert pool.insert_sequence([1, 2, 3]) == 0
    assert pool.stats.ngrams_stored == 0


def test_insert_and_lookup_equals_the_two_calls():
    grams = np.array([[1, 2, 3], [2, 3, 4], [1, 9, 9]])
    a, b = NGramPool(10, 3), NGramPool(10, 3)
    a.insert_many(grams)
    fused, fused_src = b.insert_and_lookup(grams, 1, 5)
    assert fused.tolist() == a.lookup(1, 5).tolist() == [[9, 9], [2, 3]]
    assert fused_src.tolist() == [Origin.TRAJECTORY] * 2


def test_sparse_pool_grows_beyond_its_first_allocation():
    pool = NGramPool(vocab_size=5000, n=2, slots_per_key=1, sparse=True)
    small = pool.nbytes
    keys = np.arange(1000)
    pool.insert_many(np.stack([keys, keys + 1], axis=1))
    assert pool.stats.keys_used == 1000 and pool.nbytes > small
    assert pool.lookup(999).tolist() == [[1000]]
    assert NGramPool(vocab_size=256_000, n=5, sparse=True).nbytes < NGramPool(256_000, 5).nbytes / 50


def test_save_load_round_trip(tmp_path, sparse):
    pool = NGramPool(vocab_size=50, n=3, slots_per_key=4, sparse=sparse)
    pool.insert_sequence(np.arange(20) % 7, origin=Origin.OUTPUT)
    pool.lookup(3)
    pool.save(tmp_path / "pool.npz")
    back = NGramPool.load(tmp_path / "pool.npz", vocab_size=50, n=3)
    assert back.stats == pool.stats and back.sparse == sparse
    for key in range(50):
        assert back.lookup_with_origins(key)[0].tolist() == pool.lookup_with_origins(key)[0].tolist()
    # the loaded pool keeps working: same semantics as the original
    back.insert_many(np.array([[3, 1, 1]]))
    assert back.lookup(3)[0].tolist() == [1, 1]


def test_load_rejects_mismatched_truncated_and_corrupt_files(tmp_path):
    path = tmp_path / "pool.npz"
    NGramPool(vocab_size=30, n=3).save(path)
    with pytest.raises(ValueError, match="vocab_size=30, not 31"):
        NGramPool.load(path, vocab_size=31)
    with pytest.raises(ValueError, match="3-grams, not 4-grams"):
        NGramPool.load(path, n=4)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable n-gram pool"):
        NGramPool.load(truncated)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="not a readable n-gram pool"):
        NGramPool.load(garbage)
    with pytest.raises(ValueError, match="not a readable n-gram pool"):
        NGramPool.load(tmp_path / "missing.npz")
    # well-formed npz with a wrong version / out-of-range tokens
    with np.load(path) as f:
        arrays = dict(f)
    np.savez(tmp_path / "v2.npz", **{**arrays, "format_version": np.int64(2)})
    with pytest.raises(ValueError, match="format_version: unsupported version 2"):
        NGramPool.load(tmp_path / "v2.npz")
    bad_table = arrays["table"].copy()
    bad_table[0, 0, 0] = 99
    np.savez(tmp_path / "bad.npz", **{**arrays, "table": bad_table})
    with pytest.raises(ValueError, match="table: a token id outside"):
        NGramPool.load(tmp_path / "bad.npz")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(vocab_size=0, n=3), "vocab_size must be an integer >= 1"),
        (dict(vocab_size=10, n=1), "n must be an integer >= 2"),
        (dict(vocab_size=10, n=3, slots_per_key=0), "slots_per_key must be an integer >= 1"),
        (dict(vocab_size=10.0, n=3), "vocab_size must be an integer"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NGramPool(**kwargs)


def test_bad_inputs_raise_clear_errors(sparse):
    pool = NGramPool(vocab_size=10, n=3, sparse=sparse)
    with pytest.raises(ValueError, match="token id 10 is outside the vocabulary"):
        pool.insert_many(np.array([[1, 2, 10]]))
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):
        pool.insert_many(np.array([[1, -1, 2]]))
    with pytest.raises(ValueError, match="token id 4294967296 is outside"):
        pool.insert_many(np.array([[1, 2, 2**32]]))  # would wrap to 0 if cast to int32 unchecked
    assert pool.stats.ngrams_stored == 0  # a rejected batch inserts nothing
    with pytest.raises(ValueError, match="integer token ids, got dtype float64"):
        pool.insert_many(np.array([[1.0, 2.0, 3.0]]))
    with pytest.raises(ValueError, match=r"shape \(k, 3\), got \(1, 2\)"):
        pool.insert_many(np.array([[1, 2]]))
    with pytest.raises(ValueError, match="must be 2-D"):
        pool.insert_many(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="must be 1-D"):
        pool.insert_sequence([[1, 2, 3]])
    with pytest.raises(ValueError, match="token id 12 is outside"):
        pool.insert_sequence([12])
    with pytest.raises(ValueError, match="key 10 is outside"):
        pool.lookup(10)
    with pytest.raises(ValueError, match="key -3 is outside"):
        pool.lookup(-3)
    with pytest.raises(ValueError, match="key must be an integer"):
        pool.lookup(1.5)
    with pytest.raises(ValueError, match="max_candidates must be an integer >= 0"):
        pool.lookup(1, max_candidates=-1)
    with pytest.raises(ValueError, match="origin must be in"):
        pool.insert_many(np.array([[1, 2, 3]]), origin=300)


def test_import_leaves_torch_and_transformers_out():
    code = "import sys, ngram_pool; assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import'"
    subprocess.run([sys.executable, "-c", code], check=True)


token = st.integers(0, 7)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 4),
    slots=st.integers(1, 4),
    batches=st.lists(st.lists(st.lists(token, min_size=4, max_size=4), max_size=6), max_size=6),
    sparse=st.booleans(),
)
def test_matches_the_pure_python_reference(n, slots, batches, sparse):
    pool, ref = NGramPool(8, n, slots, sparse=sparse), PyNGramPool(n, slots)
    for origin, batch in enumerate(batches):
        grams = np.array([g[:n] for g in batch], dtype=np.int64).reshape(-1, n)
        assert pool.insert_many(grams, origin=origin) == ref.insert_many(grams.tolist(), origin=origin)
        for key in range(8):
            cands, origins = pool.lookup_with_origins(key, slots)
            expected = ref.lookup(key, slots)
            assert [tuple(c) for c in cands.tolist()] == expected
            assert origins.tolist() == [ref.origins[(key,) + c] for c in expected]
