import pytest

from megarl.data import prompt_dataset


@pytest.fixture(autouse=True)
def prompt_cache_in_tmp_path(tmp_path, monkeypatch):
    """Tokenized caches of a test's files go to its own directory, not the machine's shared one."""
    monkeypatch.setattr(prompt_dataset, "DEFAULT_CACHE_DIR", tmp_path / "prompt-cache")
