"""Trace loaders: exact parsing, per-user ordering, bad lines, the truncated last line."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import TraceFormatError, load_trace, shard_map, synthetic_trace
from workloads.loaders import load_amazon, load_movielens, load_sequences, load_taobao

from .conftest import AMAZON_SAMPLE, TAOBAO_SAMPLE


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


TAOBAO_ROWS = (
    "7,100,1,pv,1000\n"
    "7,101,1,cart,1002\n"
    "7,100,1,buy,1001\n"  # out of time order in the file: sorted by (user, timestamp)
    "3,102,2,fav,900\n"
    "3,100,1,pv,950\n"
)


def test_taobao_parses_dense_ids_in_time_order(tmp_path):
    t = load_taobao(write(tmp_path, "ub.csv", TAOBAO_ROWS))
    assert (t.num_users, t.num_items, t.num_interactions) == (2, 3, 5)
    assert t.user_keys == ["7", "3"] and t.item_keys == ["100", "101", "102"]
    assert t.history(0).tolist() == [0, 0, 1]  # 100@1000, 100@1001, 101@1002
    assert t.history(1).tolist() == [2, 0]  # 102@900, 100@950
    assert t.timestamps_s.tolist() == [1000, 1001, 1002, 900, 950]
    assert t.item_category.tolist() == [0, 0, 1]
    assert t.behavior_counts == {"pv": 2, "cart": 1, "buy": 1, "fav": 1}
    assert t.num_skipped_lines == 0


def test_taobao_truncated_last_line_is_skipped_and_counted(tmp_path):
    t = load_taobao(write(tmp_path, "ub.csv", TAOBAO_ROWS + "100370,1968385,1875258,pv"))
    assert t.num_interactions == 5
    assert t.num_skipped_lines == 1
    assert t.describe()["num_skipped_lines"] == 1


def test_taobao_last_line_without_newline_that_parses_is_kept(tmp_path):
    t = load_taobao(write(tmp_path, "ub.csv", TAOBAO_ROWS + "9,103,3,pv,5"))
    assert t.num_interactions == 6 and t.num_skipped_lines == 0


@pytest.mark.parametrize("bad, message", [
    ("7,100,1,pv\n", "expected 5 comma-separated fields"),
    ("7,100,1,click,1000\n", "behavior_type 'click'"),
    ("7,100,1,pv,yesterday\n", "timestamp 'yesterday' is not a number"),
    (",100,1,pv,1000\n", "empty user_id"),
])
def test_taobao_bad_line_names_file_and_line(tmp_path, bad, message):
    lines = TAOBAO_ROWS.splitlines(keepends=True)
    p = write(tmp_path, "ub.csv", "".join(lines[:2]) + bad + "".join(lines[2:]))
    with pytest.raises(TraceFormatError) as e:
        load_taobao(p)
    assert f"{p}:3:" in str(e.value) and message in str(e.value)
    assert e.value.line_no == 3


def test_truncated_line_in_the_middle_is_an_error(tmp_path):
    # a short row followed by more rows is bad input, not truncation
    p = write(tmp_path, "ub.csv", "7,100,1,pv\n7,101,1,pv,1000")
    with pytest.raises(TraceFormatError, match=r":1: expected 5"):
        load_taobao(p)


def test_missing_file_and_directory_and_binary(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_taobao(tmp_path / "nope.csv")
    with pytest.raises(TraceFormatError, match="is a directory"):
        load_taobao(tmp_path)
    p = tmp_path / "bin.csv"
    p.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        load_taobao(p)
    with pytest.raises(ValueError, match="no interactions"):
        load_taobao(write(tmp_path, "empty.csv", ""))


def test_max_rows(tmp_path):
    t = load_taobao(write(tmp_path, "ub.csv", TAOBAO_ROWS), max_rows=2)
    assert t.num_interactions == 2


AMAZON_INTER = (
    "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    "A\tX1\t5.0\t300\n"
    "B\tX1\t4.0\t100\n"
    "A\tX2\t3.0\t200\n"
    "B\tX3\t1.0\t150\n"
)
AMAZON_ITEMS = (
    "item_id:token\ttitle:token\tcategories:token_seq\tbrand:token\tsales_type:token\tsales_rank:float\n"
    "X1\tAnno\t'Video Games', 'PC', 'Games'\tUbi\tVideo Games\t\n"
    "X2\tHalo\t'Video Games', 'Xbox'\tMS\tVideo Games\t3\n"
)


def test_amazon_sorts_rows_by_user_and_time_and_reads_categories(tmp_path):
    inter = write(tmp_path, "VG.inter", AMAZON_INTER)
    items = write(tmp_path, "VG_item.txt", AMAZON_ITEMS)  # found as a sibling by name
    t = load_amazon(inter)
    assert t.user_keys == ["A", "B"] and t.item_keys == ["X1", "X2", "X3"]
    assert t.history(0).tolist() == [1, 0]  # X2@200, X1@300
    assert t.history(1).tolist() == [0, 2]  # X1@100, X3@150
    assert t.item_category.tolist() == [0, 1, -1]  # PC, Xbox, unknown
    assert t.num_categories == 2
    assert load_amazon(inter, item_path=items).item_category.tolist() == [0, 1, -1]


def test_amazon_bad_header_and_short_row(tmp_path):
    with pytest.raises(TraceFormatError, match=r":1: header lacks timestamp"):
        load_amazon(write(tmp_path, "a.inter", "user_id:token\titem_id:token\nA\tX\n"))
    with pytest.raises(TraceFormatError, match=r":3: expected at least 4 tab-separated fields"):
        lines = AMAZON_INTER.splitlines(keepends=True)
        load_amazon(write(tmp_path, "b.inter", "".join(lines[:2]) + "C\tX9\n" + "".join(lines[2:])))


def test_movielens(tmp_path):
    t = load_movielens(write(tmp_path, "u.data", "196\t242\t3\t881250949\n186\t302\t3\t891717742\n196\t377\t1\t878887116\n"))
    assert t.num_users == 2 and t.history(0).tolist() == [2, 0]
    with pytest.raises(TraceFormatError, match=r"u2.data:2: rating 'x'"):
        load_movielens(write(tmp_path, "u2.data", "1\t2\t3\t4\n1\t2\tx\t5\n"))


def test_sequences_with_and_without_timestamps(tmp_path):
    t = load_sequences(write(tmp_path, "s.txt", "1 10\n1 11\n1 10\n2 12\n"))
    assert t.history(0).tolist() == [0, 1, 0] and t.history(1).tolist() == [2]
    t = load_sequences(write(tmp_path, "s2.txt", "u1 a 5\nu1 b 7\nu2 a 1\n"))
    assert t.timestamps_s.tolist() == [5, 7, 1]


def test_sequences_reject_ungrouped_users_and_time_travel(tmp_path):
    with pytest.raises(TraceFormatError, match=r"s.txt:3: rows of user '1' are not contiguous"):
        load_sequences(write(tmp_path, "s.txt", "1 10\n2 11\n1 12\n"))
    with pytest.raises(TraceFormatError, match=r"t.txt:2: timestamp 3 goes back"):
        load_sequences(write(tmp_path, "t.txt", "1 10 5\n1 11 3\n"))
    with pytest.raises(TraceFormatError, match=r"f.txt:1: expected 'user item \[timestamp\]'"):
        load_sequences(write(tmp_path, "f.txt", "1 2 3 4\n"))


def test_load_trace_unknown_kind():
    with pytest.raises(ValueError, match="unknown trace kind 'parquet'"):
        load_trace("parquet", "x")


def test_shard_map_is_deterministic_and_spread():
    m = shard_map(10_000, 64)
    assert m.dtype == np.int32 and m.min() >= 0 and m.max() < 64
    assert np.array_equal(m, shard_map(10_000, 64))
    counts = np.bincount(m, minlength=64)
    assert counts.min() > 100  # every shard gets items (uniform would be 156)
    with pytest.raises(ValueError):
        shard_map(10, 0)
    t = synthetic_trace(num_users=5, num_items=50, seed=1)
    assert np.array_equal(t.with_num_shards(8).item_shard, shard_map(50, 8, t.item_category))


def test_shard_map_groups_items_of_a_category():
    cats = np.array([3, 3, -1, 7, 3, -1, 7], dtype=np.int32)
    m = shard_map(7, 16, cats)
    assert m[0] == m[1] == m[4] and m[3] == m[6]
    assert m[2] == shard_map(7, 16)[2] and m[5] == shard_map(7, 16)[5]  # unknown: by item id
    with pytest.raises(ValueError, match="categories has 2 entries for 7 items"):
        shard_map(7, 16, cats[:2])


@pytest.mark.skipif(not TAOBAO_SAMPLE.exists(), reason="../shared/data not present")
def test_real_taobao_sample():
    d = load_taobao(TAOBAO_SAMPLE).describe()
    assert (d["num_users"], d["num_items"], d["num_interactions"], d["num_skipped_lines"]) == (815, 55368, 84475, 1)
    assert d["seq_len_p50"] == 78 and d["seq_len_p99"] == 431 and d["seq_len_max"] == 539
    assert d["num_categories"] == 2914
    assert abs(d["top1pct_item_share"] - 0.0697) < 1e-3


@pytest.mark.skipif(not AMAZON_SAMPLE.exists(), reason="../shared/data not present")
def test_real_amazon_sample():
    d = load_amazon(AMAZON_SAMPLE).describe()
    assert (d["num_users"], d["num_items"], d["num_interactions"]) == (794, 6626, 37341)
    assert d["num_categories"] == 43 and d["seq_len_max"] == 549 and d["seq_len_p50"] == 40


def test_a_synthetic_trace_from_a_spec_string():
    """`--trace synthetic --path SPEC`: the held-out grid's traces, made in code; the same spec is the
    same trace, a different seed another, and a bad spec a clear error."""
    t = load_trace("synthetic", "users=30,items=400,len=12,zipf=1.2,seed=5")
    assert (t.num_users, len(t.item_keys)) == (30, 400)
    assert t.source_path == "synthetic(users=30,items=400,len=12,zipf=1.2,categories=20,seed=5)"
    again = load_trace("synthetic", "seed=5,zipf=1.2,len=12,items=400,users=30")
    assert np.array_equal(t.items, again.items) and np.array_equal(t.offsets, again.offsets)
    assert not np.array_equal(load_trace("synthetic", "users=30,items=400,len=12,zipf=1.2,seed=6").items[:50],
                              t.items[:50])
    assert load_trace("synthetic").num_users == 200  # the defaults
    with pytest.raises(ValueError, match="want key=value pairs with keys users, items, len, zipf, categories, seed"):
        load_trace("synthetic", "users=30,colour=blue")
    with pytest.raises(ValueError, match="items wants a int, got 'many'"):
        load_trace("synthetic", "items=many")
    with pytest.raises(ValueError, match="must be positive"):
        load_trace("synthetic", "users=0")
