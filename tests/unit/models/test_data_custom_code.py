"""A Hugging Face folder that names code of its own (``auto_map``) is refused, and none of that code runs, even
where transformers would ask whether to run it and the answer is yes."""

from __future__ import annotations

import builtins
import json

import pytest

pytest.importorskip("transformers")


def _folder_with_code(tmp_path, config_name: str, fields: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    marker = tmp_path / "MARKER"
    (folder / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'custom'\n"
    )
    (folder / config_name).write_text(json.dumps(fields))
    return folder, marker


def test_pretrained_folder_with_custom_code_is_refused(tmp_path, monkeypatch):
    from lightning_async_pp.models import CausalLM

    folder, marker = _folder_with_code(
        tmp_path, "config.json", {"model_type": "custom", "auto_map": {"AutoConfig": "custom.CustomConfig"}}
    )
    monkeypatch.setattr(builtins, "input", lambda *args: "y")  # transformers' prompt, answered yes
    with pytest.raises(ValueError, match=r"config\.json names Python code of its own .*trust_remote_code=False"):
        CausalLM(pretrained=str(folder))
    assert not marker.exists()


def test_tokenizer_folder_with_custom_code_is_refused(tmp_path):
    from lightning_async_pp.models.data import local_tokenizer

    folder, marker = _folder_with_code(
        tmp_path, "tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["custom.CustomTokenizer", None]}}
    )
    with pytest.raises(ValueError, match=r"tokenizer_config\.json names Python code of its own"):
        local_tokenizer(folder)
    assert not marker.exists()


def test_config_cannot_ask_for_remote_code():
    from lightning_async_pp.models import CausalLM

    with pytest.raises(ValueError, match="`config` cannot set trust_remote_code"):
        CausalLM(model_type="llama", config={"trust_remote_code": True})
