"""The GSM8K and MATH preprocessing examples on tiny local files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import load_rows
from megarl.rewards import compute_score

SCRIPTS = Path(__file__).resolve().parents[3] / "examples" / "data_preprocess"


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"preprocess_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gsm8k = load_script("gsm8k")
math_dataset = load_script("math_dataset")

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs twice.", "answer": "1,200 * 2 = 2,400\n#### 2,400"},
]
MATH = [
    {"problem": "What is $1/2$ as a fraction?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "Compute $\\sqrt{8}$.", "solution": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$"},
    {"problem": "Solve.", "solution": "So $x = \\boxed 5$."},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k(tmp_path, suffix):
    source = tmp_path / f"gsm8k{suffix}"
    if suffix == ".jsonl":
        source.write_text("\n".join(json.dumps(r) for r in GSM8K) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(GSM8K), source)
    output = tmp_path / "out" / "train.parquet"
    gsm8k.main(["--input", str(source), "--output", str(output), "--split", "train"])
    rows = load_rows([str(output)])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "2400"]
    assert rows[0]["prompt"][0]["content"] == (
        "Tom has 3 apples and buys 4. How many? Let's think step by step and output the final answer after \"####\".")
    assert rows[1]["extra_info"]["split"] == "train" and rows[1]["extra_info"]["index"] == 1
    for r, record in zip(rows, GSM8K):
        assert r["data_source"] == "openai/gsm8k"
        assert compute_score(r["data_source"], record["answer"], r["reward_model"]["ground_truth"]) == 1.0


def test_gsm8k_answer_without_marker(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(GSM8K[0]) + "\n" + json.dumps({"question": "q", "answer": "just 5"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1, key 'answer': expected it to end with '#### <number>'"):
        gsm8k.main(["--input", str(source), "--output", str(tmp_path / "o.parquet"), "--split", "test"])


@pytest.mark.parametrize("layout", ["json", "jsonl", "one-problem json"])
def test_math(tmp_path, layout):
    records = MATH[:1] if layout == "one-problem json" else MATH
    source = tmp_path / ("math.jsonl" if layout == "jsonl" else "math.json")
    if layout == "jsonl":
        source.write_text("\n".join(json.dumps(r) for r in records))
    else:
        source.write_text(json.dumps(records[0] if layout == "one-problem json" else records))
    output = tmp_path / "test.parquet"
    math_dataset.main(["--input", str(source), "--output", str(output), "--split", "test"])
    rows = load_rows([str(output)])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "2\\sqrt{2}", "5"][:len(records)]
    assert rows[0]["prompt"][0]["content"].endswith(
        "? Let's think step by step and output the final answer within \\boxed{}.")
    for r, record in zip(rows, records):
        assert compute_score(r["data_source"], record["solution"], r["reward_model"]["ground_truth"]) == 1.0


def test_last_boxed_content():
    assert math_dataset.last_boxed_content("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert math_dataset.last_boxed_content("\\fbox{x^{2}}") == "x^{2}"
    assert math_dataset.last_boxed_content("\\boxed{unbalanced") is None
    assert math_dataset.last_boxed_content("no answer") is None


def test_math_missing_key(tmp_path):
    source = tmp_path / "m.jsonl"
    source.write_text(json.dumps({"problem": "p"}))
    with pytest.raises(ValueError, match=r"m.jsonl: row 0, key 'solution': expected a str, got None"):
        math_dataset.main(["--input", str(source), "--output", str(tmp_path / "o.parquet"), "--split", "test"])
