"""load_tokenizer (loader/model_files.py) parses a directory's tokenizer once per process and
template, and parses it again when the directory's files change: engines over one model share
the object, and an edited tokenizer is never served stale."""
from __future__ import annotations

import os

from pagedllm.loader import load_tokenizer

from .fakes import byte_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


def saved(tmp_path):
    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_one_parse_per_directory_and_template(tmp_path):
    d = saved(tmp_path)
    first = load_tokenizer(d)
    assert load_tokenizer(d) is first
    templated = load_tokenizer(d, TEMPLATE)
    assert templated is not first and templated.chat_template == TEMPLATE
    assert load_tokenizer(d, TEMPLATE) is templated
    assert getattr(first, "chat_template", None) != TEMPLATE   # the template went on its own object


def test_a_changed_file_is_parsed_again(tmp_path):
    d = saved(tmp_path)
    first = load_tokenizer(d)
    config = d / "tokenizer_config.json"
    text = config.read_text().replace('"</s>"', '"<unk>"', 1)   # another eos token
    config.write_text(text)
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # a coarse clock still sees the edit
    again = load_tokenizer(d)
    assert again is not first
    assert again.eos_token == "<unk>" and first.eos_token == "</s>"
