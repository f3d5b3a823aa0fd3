"""Reading and validating parquet prompt rows, and tokenizing them into a PromptDataset."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import PromptDataset, load_rows, write_rows

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT / "checkpoints_tools"))
import make_tiny_model  # noqa: E402


def row(content="1+2=", ground_truth="3", **overrides):
    base = {
        "prompt": [{"role": "user", "content": content}],
        "data_source": "arithmetic",
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"index": 0},
    }
    return {**base, **overrides}


def rows_with_row3(**overrides):
    return [row(), row(), row(), row(**overrides), row()]


def write_table(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_empty(path):
    schema = pa.Table.from_pylist([row()]).schema
    pq.write_table(schema.empty_table(), path)


def write_corrupt(path):
    Path(path).write_bytes(b"PAR1 this is not really parquet PAR1")


# (name, writer, pieces the single-line message must contain besides the file name)
ERROR_CASES = [
    ("missing column", lambda p: write_table(p, [{k: v for k, v in row().items() if k != "data_source"}]),
     ["missing column 'data_source'"]),
    ("data_source null in row 3", lambda p: write_table(p, rows_with_row3(data_source=None)),
     ["row 3", "column 'data_source'", "expected a str"]),
    ("empty prompt in row 3", lambda p: write_table(p, rows_with_row3(prompt=[])),
     ["row 3", "column 'prompt'", "expected a non-empty list of {role: str, content: str} dicts or a str"]),
    ("null content in row 3", lambda p: write_table(p, rows_with_row3(prompt=[{"role": "user", "content": None}])),
     ["row 3", "column 'prompt'", "expected a non-empty list"]),
    ("null ground truth in row 3",
     lambda p: write_table(p, rows_with_row3(reward_model={"style": "rule", "ground_truth": None})),
     ["row 3", "column 'reward_model.ground_truth'", "expected a str"]),
    ("reward_model without ground_truth", lambda p: write_table(p, [row(reward_model={"style": "rule"})]),
     ["row 0", "column 'reward_model'", "with a 'ground_truth' key"]),
    ("integer prompt", lambda p: write_table(p, [row(prompt=7)]),
     ["row 0", "column 'prompt'", "got int 7"]),
    ("extra_info a string", lambda p: write_table(p, [row(extra_info="x")]),
     ["row 0", "column 'extra_info'", "expected a dict or null"]),
    ("empty file", write_empty, ["0 rows"]),
    ("corrupt file", write_corrupt, ["cannot read as parquet"]),
]


@pytest.mark.parametrize("name, writer, pieces", ERROR_CASES, ids=[case[0] for case in ERROR_CASES])
def test_bad_files_give_one_line_errors(tmp_path, name, writer, pieces):
    good = tmp_path / "good.parquet"
    write_rows([row()], good)
    bad = tmp_path / "bad.parquet"
    writer(bad)
    with pytest.raises(ValueError) as error:
        load_rows([str(good), str(bad)])
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{bad}: ")
    for piece in pieces:
        assert piece in message


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nope.parquet: data file does not exist"):
        load_rows([str(tmp_path / "nope.parquet")])


def test_rows_are_normalised(tmp_path):
    path, plain = tmp_path / "rows.parquet", tmp_path / "plain.parquet"
    write_table(path, [row(extra_info=None)])
    write_table(plain, [row(prompt="plain text", ability=None)])  # a column holds lists or strings, not both
    first, second = load_rows([str(path), str(plain)])
    assert first["extra_info"] == {} and first["prompt"] == [{"role": "user", "content": "1+2="}]
    assert second["prompt"] == "plain text" and second["ability"] == ""
    write_rows([row(extra_info={}), row(extra_info={})], path)  # parquet cannot hold an empty struct
    assert [r["extra_info"] for r in load_rows([str(path)])] == [{}, {}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_model.make_tokenizer()


def char_ids(tokenizer, text):
    return tokenizer.convert_tokens_to_ids([make_tiny_model.character_token(c) for c in text])


def test_chat_template_is_applied(tmp_path, tokenizer):
    path = tmp_path / "chat.parquet"
    write_rows([row("123+456=", "579", extra_info={"split": "train"})], path)
    prompt = PromptDataset([str(path)], tokenizer, max_prompt_length=64)[0]
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    # <|im_start|>user\n123+456=<|im_end|>\n<|im_start|>assistant\n, one id per character
    expected = ([start] + char_ids(tokenizer, "user\n123+456=") + [end] + char_ids(tokenizer, "\n")
                + [start] + char_ids(tokenizer, "assistant\n"))
    assert prompt.prompt_ids == expected
    assert (prompt.data_source, prompt.ground_truth, prompt.extra_info, prompt.index) == (
        "arithmetic", "579", {"split": "train"}, 0)


def test_raw_text_without_template(tmp_path, tokenizer):
    chat, plain = tmp_path / "chat.parquet", tmp_path / "plain.parquet"
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    write_rows([row(prompt=messages)], chat)
    write_rows([row(prompt="Q: 2+2=")], plain)
    files = [str(chat), str(plain)]
    raw = PromptDataset(files, tokenizer, max_prompt_length=64, apply_chat_template=False)
    assert raw[0].prompt_ids == char_ids(tokenizer, "Add.\n1+2=")
    assert raw[1].prompt_ids == char_ids(tokenizer, "Q: 2+2=")  # a string prompt is always raw
    templated = PromptDataset(files, tokenizer, max_prompt_length=64)
    assert templated[1].prompt_ids == char_ids(tokenizer, "Q: 2+2=")
    no_template = make_tiny_model.make_tokenizer()
    no_template.chat_template = None
    assert PromptDataset(files, no_template, max_prompt_length=64)[0].prompt_ids == raw[0].prompt_ids


def test_long_prompts_are_filtered_and_counted(tmp_path, tokenizer, caplog):
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_rows([row("1+1="), row("9" * 40)], first)
    write_rows([row("9" * 50), row("2+2=")], second)
    with caplog.at_level("WARNING"):
        dataset = PromptDataset([str(first), str(second)], tokenizer, max_prompt_length=20,
                                apply_chat_template=False)
    assert dataset.num_filtered == 2 and len(dataset) == 2
    assert [p.index for p in dataset] == [0, 3]  # positions across both files, before filtering
    assert "filtered 2 of 4 prompts" in caplog.text


def test_all_filtered_raises(tmp_path, tokenizer):
    path = tmp_path / "long.parquet"
    write_rows([row("9" * 30), row("8" * 30)], path)
    with pytest.raises(ValueError, match=rf"all 2 prompts of {path} are longer than max_prompt_length=10"):
        PromptDataset([str(path)], tokenizer, max_prompt_length=10)
