"""bench/bits.py: the kernel A/B's bit-for-bit gate. compare on made-up dumps (here), dump on the
GPU (marked; skips without one, saying why)."""

from __future__ import annotations

import numpy as np
import pytest

from openjet_plugin.bench import bits


def _dump(seed: int = 0, rows: int = 6, cols: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    main = rng.standard_normal((rows, cols)).astype(np.float32) * 4
    return {"main": np.stack([main] * len(bits.CALL_SIZES)),
            "mtp": rng.standard_normal((3, cols)).astype(np.float32) * 4}


def _save(tmp_path, name, rows):
    p = tmp_path / name
    np.savez(p, **rows)
    return str(p)


def test_identical_dumps_pass_the_gate(tmp_path, capsys):
    a = _dump()
    result = bits.compare(a, _dump())
    assert result["main"] == {"rows": 18, "bit_identical": True, "top1": 1.0, "kl_mean": 0.0, "kl_max": 0.0,
                              "max_abs": 0.0}
    assert result["mtp"]["bit_identical"]
    assert bits.main(["compare", _save(tmp_path, "a.npz", a), _save(tmp_path, "b.npz", _dump())]) == 0
    assert "main: rows 18 bit-identical True top1 1.0000" in capsys.readouterr().out


def test_one_changed_ulp_fails_the_gate_and_is_measured(tmp_path, capsys):
    a, b = _dump(), _dump()
    b["mtp"][1, 5] = np.nextafter(b["mtp"][1, 5], np.float32(np.inf))   # one value, one ulp
    result = bits.compare(a, b)
    assert result["main"]["bit_identical"] and not result["mtp"]["bit_identical"]
    assert result["mtp"]["top1"] == 1.0 and 0.0 < result["mtp"]["max_abs"] < 1e-5
    assert bits.main(["compare", _save(tmp_path, "a.npz", a), _save(tmp_path, "b.npz", b)]) == 1
    assert "mtp: rows 3 bit-identical False" in capsys.readouterr().out


def test_a_changed_argmax_shows_in_top1_and_kl():
    a, b = _dump(), _dump()
    row = b["main"][0, 2]
    row[np.argmin(row)] = row.max() + 3.0    # another token wins that row
    r = bits.compare(a, b)["main"]
    assert not r["bit_identical"]
    assert r["top1"] == pytest.approx(17 / 18)
    assert r["kl_max"] > 0.1 and r["kl_mean"] == pytest.approx(r["kl_max"] / 18)


def test_a_dump_whose_call_sizes_differ_fails_even_against_itself(tmp_path, capsys):
    a = _dump()
    a["main"][2, 0, 0] += 1.0                 # the 1-position calls differ from the 8-position ones
    assert not bits.calls_agree(a)
    p = _save(tmp_path, "a.npz", a)
    assert bits.main(["compare", p, p]) == 1
    assert "calls of 8 / 5 / 1 positions bit-identical: False" in capsys.readouterr().out


def test_dumps_of_other_shapes_are_refused_by_name():
    b = _dump(cols=32)
    with pytest.raises(bits.BitsError, match="main: rows of shape"):
        bits.compare(_dump(), b)


def test_a_missing_file_or_a_file_that_is_no_dump_is_named(tmp_path, capsys):
    good = _save(tmp_path, "a.npz", _dump())
    assert bits.main(["compare", good, str(tmp_path / "absent.npz")]) == 2
    assert f"{tmp_path / 'absent.npz'}: not a dump" in capsys.readouterr().err
    np.savez(tmp_path / "other.npz", logits=np.zeros((3, 4)))
    assert bits.main(["compare", good, str(tmp_path / "other.npz")]) == 2
    assert "other.npz: no 'main' rows of 3 call sizes (holds ['logits'])" in capsys.readouterr().err
    (tmp_path / "text.npz").write_text("not numpy")
    assert bits.main(["compare", str(tmp_path / "text.npz"), good]) == 2
    assert "text.npz: not a dump" in capsys.readouterr().err


def test_dump_of_a_missing_model_is_named(tmp_path, capsys):
    assert bits.main(["dump", "--model", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "a.npz")]) == 2
    assert "absent.gguf" in capsys.readouterr().err
    assert not (tmp_path / "a.npz").exists()


def test_dump_with_a_negative_depth_is_refused_by_name(tmp_path, capsys):
    assert bits.main(["dump", "--model", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "a.npz"),
                      "--depth", "-1"]) == 2
    assert "--depth" in capsys.readouterr().err
    assert not (tmp_path / "a.npz").exists()


@pytest.mark.gpu
def test_dump_after_a_prefilled_depth_keeps_the_call_size_invariant(tmp_path):
    from test_native_gpu import _native_or_skip, model_path

    _native_or_skip()
    model, _ = model_path("tiny", "Q4_K_M", tmp_path)
    a = bits.dump(model, tmp_path / "a.npz", depth=300)
    b = bits.dump(model, tmp_path / "b.npz")
    assert bits.calls_agree(a)
    # the prefix changes every row: the dump at depth is not the dump at 0
    assert not np.array_equal(a["main"], b["main"])


@pytest.mark.gpu
def test_dump_of_one_library_twice_is_bit_identical(tmp_path):
    from test_native_gpu import _native_or_skip, model_path

    _native_or_skip()
    model, _ = model_path("tiny", "Q4_K_M", tmp_path)
    a = bits.dump(model, tmp_path / "a.npz")
    b = bits.dump(model, tmp_path / "b.npz")
    assert bits.calls_agree(a)
    assert set(a) == {"main", "mtp"} and a["main"].shape[:2] == (len(bits.CALL_SIZES), bits.TOKENS)
    assert all(r["bit_identical"] for r in bits.compare(a, b).values())
