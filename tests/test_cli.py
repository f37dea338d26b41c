"""``deepinfer-jax`` command-line errors: exit code 2 and ``error: --flag: ...`` on stderr, no
traceback, and everything the command line alone decides is checked before a model is loaded
(these runs name a model directory that does not exist: the flag's error must come first)."""

from __future__ import annotations

import os

import pytest

from deepinfer_jax.entrypoints.cli import main

NO_MODEL = ["generate", "--model", "/nonexistent/dir"]


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "1.5"], "error: --top-p: 1.5: must be in (0, 1]"),
    (["--temperature", "-1"], "error: --temperature: -1.0: must be a finite number >= 0"),
    (["--max-tokens", "0"], "error: --max-tokens: 0: must be >= 1"),
    (["--top-k", "-5"], "error: --top-k: -5: must be 0 or -1 (off) or an integer >= 1"),
    (["--n", "0"], "error: --n: 0: must be >= 1"),
    (["--seed", "-2"], "error: --seed: -2: must be None or an integer in [0, 2**63)"),
    (["--token-buckets", "64,abc"], "error: --token-buckets: '64,abc': expected comma-separated integers"),
    (["--prompt-ids", "1,,2"], "error: --prompt-ids: '1,,2': expected comma-separated integers"),
    (["--prompt-ids", "1,2,"], "error: --prompt-ids: '1,2,': expected comma-separated integers"),
    (["--repeat", "0"], "error: --repeat: 0: must be >= 1"),
])
def test_bad_flag_reported_before_loading(argv, message, capsys):
    assert main(NO_MODEL + argv) == 2
    err = capsys.readouterr().err
    assert f"deepinfer-jax generate: {message}" in err, err
    assert "Traceback" not in err and "model=" not in err


def test_stats_json_folder_checked_up_front(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(NO_MODEL + ["--stats-json", str(blocker / "stats.json")]) == 2
    err = capsys.readouterr().err
    assert "error: --stats-json: cannot create the folder" in err and "model=" not in err
    assert main(NO_MODEL + ["--stats-json", str(tmp_path)]) == 2
    assert "error: --stats-json: " in capsys.readouterr().err
    made = tmp_path / "new" / "sub"
    assert main(NO_MODEL + ["--stats-json", str(made / "stats.json")]) == 2  # the model error, after
    assert os.path.isdir(made) and "model='/nonexistent/dir'" in capsys.readouterr().err


def test_convert_takes_a_preset_name(tmp_path, monkeypatch, capsys):
    from deepinfer_jax.checkpoint.orbax_io import is_orbax_dir

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "orbax"
    assert main(["convert", "--model", "v41-tiny", "--out", str(out), "--no-progress"]) == 0
    assert is_orbax_dir(str(out)) and f"wrote {out}" in capsys.readouterr().out
    assert os.path.isdir(tmp_path / "cache" / "v41-tiny-random-seed0")
    assert main(["convert", "--model", "nope", "--out", str(out)]) == 2
    assert "error: model='nope': not a directory, a shipped model" in capsys.readouterr().err
