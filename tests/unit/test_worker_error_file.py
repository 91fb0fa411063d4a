"""A worker's error file cut short (stopped while writing it) is set aside, a whole one kept."""

import json

from dlrover_torch.worker_pool import _set_aside_if_unreadable


def test_a_cut_short_error_file_is_set_aside_and_a_whole_one_kept(tmp_path):
    cut = tmp_path / "cut.json"
    cut.write_text('{"message": {"mess')
    empty = tmp_path / "empty.json"
    empty.write_text("")
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"message": {"message": "boom"}}))
    for path in (cut, empty, whole, tmp_path / "missing.json"):
        _set_aside_if_unreadable(str(path))
    assert not cut.exists() and (tmp_path / "cut.json.partial").exists()
    assert not empty.exists() and (tmp_path / "empty.json.partial").exists()
    assert json.loads(whole.read_text())["message"]["message"] == "boom"
