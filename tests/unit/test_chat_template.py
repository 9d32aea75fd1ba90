"""``model.chat_template``: a template of one's own for the prompts (text or a file), and its one-line errors."""

from __future__ import annotations

import pytest

from hybrid_rl.models import ModelLoadError, load_tokenizer, read_chat_template
from hybrid_rl.preflight import check_chat_template

R1_ZERO = ("A conversation between User and Assistant. User: {{ messages[-1]['content'] }} Assistant:"
           "{% if add_generation_prompt %} <think>{% endif %}")


def test_a_template_text_replaces_the_tokenizers(tiny_model_path):
    tok = load_tokenizer(tiny_model_path, chat_template=R1_ZERO)
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False)
    assert text == "A conversation between User and Assistant. User: 2+2? Assistant: <think>"
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert tok.decode(ids) == text


def test_a_template_file(tiny_model_path, tmp_path):
    path = tmp_path / "zero.jinja"
    path.write_text(R1_ZERO)
    assert read_chat_template(str(path)) == R1_ZERO
    assert load_tokenizer(tiny_model_path, chat_template=str(path)).chat_template == R1_ZERO


@pytest.mark.parametrize("template, words", [
    ("{% if %}", "not a valid Jinja template"),
    ("no messages here", None),
])
def test_bad_templates_are_one_line_errors(tiny_model_path, template, words):
    if words:
        with pytest.raises(ModelLoadError) as ei:
            check_chat_template(template)
        assert str(ei.value).startswith("model.chat_template: not a valid Jinja template") and "\n" not in str(ei.value)
    else:
        check_chat_template(template)  # valid Jinja: only rendering it shows the user's message is missing
        with pytest.raises(ModelLoadError) as ei:
            load_tokenizer(tiny_model_path, chat_template=template)
        assert "the chat template leaves out the user's message" in str(ei.value) and "\n" not in str(ei.value)


def test_a_missing_template_file(tmp_path):
    with pytest.raises(ModelLoadError) as ei:
        read_chat_template(str(tmp_path / "none.jinja"))
    assert str(ei.value).startswith("model.chat_template=") and "cannot read the file" in str(ei.value)
