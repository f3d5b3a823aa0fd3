"""The tokenized, memory-mapped PromptDataset: items equal the tokenizer's own output, the cache is
built once and follows its file, a rank's memory does not grow with the rows, bad rows name file and row."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import sys
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import PromptDataset, prompt_dataset, write_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "checkpoints_tools"))
import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_model.make_tokenizer(bos=True)


def _row(prompt, ground_truth="3", **overrides):
    return {"prompt": prompt, "data_source": "arithmetic", "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, **overrides}


def _expected_ids(tokenizer, prompt):
    """What the model should see, straight from the tokenizer: the template's text with no added
    specials, or raw text with the tokenizer's own specials minus a trailing EOS."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_items_equal_the_tokenizers_ids_and_the_cache_is_built_once(tmp_path, tokenizer):
    messages = [[{"role": "user", "content": f"{a}+{a + 1}="}] for a in range(5)]
    messages[2] = [{"role": "system", "content": "Add."}, {"role": "user", "content": "7+8="}]
    chat = write_rows([_row(m, str(i), extra_info={"index": i}) for i, m in enumerate(messages)],
                      tmp_path / "chat.parquet")
    plain = tmp_path / "plain.parquet"  # extra_info as a map column, null in one row
    pq.write_table(pa.table({"prompt": ["Q: 2+2=", "Q: 30+4="], "data_source": ["arithmetic"] * 2,
                             "reward_model": [{"style": "rule", "ground_truth": "4"},
                                              {"style": "rule", "ground_truth": "34"}],
                             "extra_info": pa.array([[("k", 1)], None], pa.map_(pa.string(), pa.int64()))}), plain)
    first = PromptDataset([chat, str(plain)], tokenizer, max_prompt_length=64, cache_dir=tmp_path / "cache")
    assert first.num_built == 2 and len(first) == 7
    for i, prompt in enumerate(messages + ["Q: 2+2=", "Q: 30+4="]):
        assert first[i].prompt_ids == _expected_ids(tokenizer, prompt)
        assert first[i].index == i
    assert (first[2].ground_truth, first[2].extra_info, first[2].data_source) == ("2", {"index": 2}, "arithmetic")
    assert (first[5].ground_truth, first[5].extra_info, first[6].extra_info) == ("4", {"k": 1}, {})
    assert (first[4].origin, first[6].origin) == (f"{chat}: row 4", f"{plain}: row 1")
    again = PromptDataset([chat, str(plain)], tokenizer, max_prompt_length=64, cache_dir=tmp_path / "cache")
    assert again.num_built == 0 and [p.prompt_ids for p in again] == [p.prompt_ids for p in first]
    assert "7 prompts (7 rows, 0 over max_prompt_length)" in again.describe()


def test_a_changed_file_or_tokenizer_setting_gets_its_own_cache(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "40+50="}]
    path = write_rows([_row("1+2=")], tmp_path / "data.parquet")
    raw = PromptDataset([path], tokenizer, 64, apply_chat_template=False)
    assert raw[0].prompt_ids == _expected_ids(tokenizer, "1+2=")
    write_rows([_row(messages), _row([{"role": "user", "content": "6+6="}])], path)
    changed = PromptDataset([path], tokenizer, 64, apply_chat_template=False)
    assert changed.num_built == 1 and [p.prompt_ids for p in changed] == [
        _expected_ids(tokenizer, "40+50="), _expected_ids(tokenizer, "6+6=")]  # raw text: BOS + characters
    templated = PromptDataset([path], tokenizer, 64, apply_chat_template=True)
    assert templated.num_built == 1 and templated[0].prompt_ids == _expected_ids(tokenizer, messages)


def _open_in_child(args):
    path, cache_dir = args
    return PromptDataset([path], make_tiny_model.make_tokenizer(bos=True), 64, cache_dir=cache_dir).num_built


def test_the_ranks_of_a_node_build_once(tmp_path):
    path = write_rows([_row(f"{a}+1=") for a in range(2000)], tmp_path / "data.parquet")
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert sorted(pool.map(_open_in_child, [(path, tmp_path / "cache")] * 2)) == [0, 1]


def test_a_rank_holds_a_small_index_per_row_not_the_rows(tmp_path, tokenizer):
    num_rows = 10000
    content = "Add the numbers {} and 12345, then write the sum."
    path = write_rows([_row([{"role": "user", "content": content.format(i)}], str(i), extra_info={"index": i})
                       for i in range(num_rows)], tmp_path / "big.parquet")
    PromptDataset([path], tokenizer, 256)  # builds the cache
    cache_bytes = sum(f.stat().st_size for f in (tmp_path / "prompt-cache").glob("*.arrow"))
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    dataset = PromptDataset([path], tokenizer, 256)
    batch = [dataset[i] for i in range(0, num_rows, num_rows // 64)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert dataset.num_built == 0 and batch[1].ground_truth == str(num_rows // 64)
    assert pa.total_allocated_bytes() - arrow_before == 0  # the tokens stay in the mapped file
    # int64 row indexes and one transient int64 length array: 16 bytes a row, plus a little slack
    assert peak < 16 * num_rows + (128 << 10) < cache_bytes / 4, (peak, cache_bytes)


def test_a_bad_row_fails_naming_file_and_row_and_leaves_no_cache(tmp_path, tokenizer):
    good = write_rows([_row("1+2=")], tmp_path / "good.parquet")
    bad = write_rows([_row("1+2="), _row("2+2="), _row("<|bos|>3+3=")], tmp_path / "bad.parquet")
    for _ in range(2):  # a second rank after the first failed: the same error, not a half-written cache
        with pytest.raises(ValueError) as error:
            PromptDataset([good, bad], tokenizer, 64, apply_chat_template=False)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{bad}: prompt 2 (1 of 3 prompts) starts with the BOS")
    assert [f.name.startswith("good-") for f in (tmp_path / "prompt-cache").glob("*.arrow")] == [True]
    rows = [_row("1+2=")] * 9000  # rows are read a batch at a time: the row is counted across batches
    rows[8500] = _row("2+2=", ground_truth=None)
    missing_ground_truth = write_rows(rows, tmp_path / "gt.parquet")
    with pytest.raises(ValueError, match=rf"^{missing_ground_truth}: row 8500, column 'reward_model.ground_truth'"):
        PromptDataset([missing_ground_truth], tokenizer, 64)
    assert not os.path.exists(tmp_path / "nope.parquet")
    with pytest.raises(ValueError, match="nope.parquet: data file does not exist"):  # before any tokenizing
        PromptDataset([good, str(tmp_path / "nope.parquet")], tokenizer, 64)


def test_caches_no_job_opened_for_a_week_are_deleted_at_the_next_build(tmp_path, tokenizer):
    cache_dir, week = tmp_path / "prompt-cache", prompt_dataset.UNUSED_CACHE_SECONDS
    files = {name: write_rows([_row(f"{i}+2=")], tmp_path / f"{name}.parquet")
             for i, name in enumerate(("stale", "reopened", "busy", "new"))}
    for name in ("stale", "reopened", "busy"):
        PromptDataset([files[name]], tokenizer, 64)
    eight_days_ago = time.time() - week - 24 * 3600
    for cache in cache_dir.glob("*.arrow"):
        os.utime(cache, (eight_days_ago, eight_days_ago))
    assert PromptDataset([files["reopened"]], tokenizer, 64).num_built == 0  # opening it marks it used
    busy = next(cache_dir.glob("busy-*.arrow"))
    with open(busy.with_suffix(".lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # a job is opening it
        PromptDataset([files["new"]], tokenizer, 64)
    assert sorted(cache.name.split("-")[0] for cache in cache_dir.glob("*.arrow")) == ["busy", "new", "reopened"]
    assert sorted(lock.name.split("-")[0] for lock in cache_dir.glob("*.lock")) == ["busy", "new", "reopened"]
