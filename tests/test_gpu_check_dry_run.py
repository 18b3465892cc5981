"""benchmarks/gpu_check.py runs its code paths on CPU (`--dry-run`), so the script a GPU session
relies on cannot rot between GPU sessions."""

from __future__ import annotations

from benchmarks import gpu_check


def test_the_gpu_check_passes_in_its_dry_run_on_cpu(tmp_path, capsys):
    status = gpu_check.main(["--dry-run", "--fast", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    results = gpu_check.RESULTS
    assert status == 0, printed
    assert {name[:3] for name, _, _ in results} == {"(a)", "(b)", "(c)", "(d)"}, printed
    assert all(ok for _, ok, _ in results), printed
    assert (tmp_path / "gpu_check_trace.json").stat().st_size > 0
