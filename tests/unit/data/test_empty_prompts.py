"""A prompt without text (it would tokenize to nothing and kill the run mid-step in vLLM) is refused at load."""

from __future__ import annotations

import pytest

from megarl.data import load_rows, write_rows


def _row(prompt):
    return {"prompt": prompt, "data_source": "arithmetic", "reward_model": {"style": "rule", "ground_truth": "3"}}


@pytest.mark.parametrize("prompt", [
    "",
    "  \n",
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": " "}, {"role": "user", "content": ""}],
], ids=["empty str", "blank str", "one empty message", "blank messages"])
def test_a_prompt_without_text_is_refused_naming_file_row_and_column(tmp_path, prompt):
    good = "1+2=" if isinstance(prompt, str) else [{"role": "user", "content": "1+2="}]  # one schema per file
    file = write_rows([_row(good), _row(prompt)], tmp_path / "train.parquet")
    with pytest.raises(ValueError) as error:
        load_rows([file])
    message = str(error.value)
    assert message.startswith(f"{file}: row 1, column 'prompt': expected some text") and "\n" not in message


def test_a_prompt_with_some_text_is_kept(tmp_path):
    prompt = [{"role": "system", "content": ""}, {"role": "user", "content": "1+2="}]
    file = write_rows([_row(prompt)], tmp_path / "train.parquet")
    assert load_rows([file])[0]["prompt"] == prompt
