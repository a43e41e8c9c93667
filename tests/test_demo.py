from ucp_zarr.cli import main


def test_demo_resumes_bit_exactly(capsys):
    assert main(["demo", "--steps", "6", "--save-at", "3"]) == 0
    assert "bit for bit" in capsys.readouterr().out


def test_info_and_verify(tmp_path, capsys):
    import torch

    import ucp_zarr

    ucp_zarr.save({"model": {"w": torch.ones(4, 4)}, "step": 3}, tmp_path / "ck")
    assert main(["info", str(tmp_path / "ck")]) == 0
    assert main(["verify", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "w/" in out and '"step": 3' in out and "ok: 1 tensors, 64 bytes" in out
