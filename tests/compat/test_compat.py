"""The framework seams: each touched private name exists in the installed version, and a missing one fails clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardsafe.compat import CompatError, installed_version, missing


def test_missing_names_the_installed_version_and_the_checked_range() -> None:
    err = missing("torch", "torch.something_private", ">=9.0, checked on 9.0")
    assert isinstance(err, CompatError)
    assert f"installed torch {installed_version('torch')}" in str(err)
    assert ">=9.0, checked on 9.0" in str(err) and "torch.something_private" in str(err)
    assert installed_version("no-such-distribution-shardsafe") == "not installed"


def test_transformers_seams_exist_and_the_patch_is_undone() -> None:
    pytest.importorskip("transformers")
    import transformers.trainer as hf_trainer

    from shardsafe.compat import transformers as compat

    compat.check_trainer()  # every overridden private Trainer method is in the installed transformers
    assert compat.skips_batches_by_function()
    original = hf_trainer.skip_first_batches
    with compat.trainer_skips_nothing():
        loader = [1, 2, 3]
        assert hf_trainer.skip_first_batches(loader, 2) is loader
    assert hf_trainer.skip_first_batches is original

    class Args:
        save_total_limit = 1

    args = Args()
    with compat.save_total_limit_hidden(args):
        assert args.save_total_limit is None
    assert args.save_total_limit == 1
    with pytest.raises(CompatError, match=r"Trainer\._train_batch_size.*installed transformers"):
        compat.train_batch_size(object())


def test_accelerate_registries_of_a_real_accelerator() -> None:
    pytest.importorskip("accelerate")
    import torch
    from accelerate import Accelerator

    from shardsafe.compat.accelerate import registries

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    found = registries(accelerator)
    assert found.models == [model] and found.optimizers == [] and found.custom_objects == []
    with pytest.raises(CompatError, match=r"Accelerator\._models.*installed accelerate"):
        registries(object())


def test_tracked_add_reports_the_bytes_read(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    from shardsafe.compat.huggingface_hub import tracked_add_class

    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 1000)
    op = tracked_add_class()(path_in_repo="w.bin", path_or_fileobj=str(path))
    seen: list[int] = []
    op.on_read = seen.append
    with op.as_file(with_tqdm=True) as file:
        while file.read(300):
            pass
    assert seen[-1] == 1000 and seen[:3] == [300, 600, 900]
    plain = tracked_add_class()(path_in_repo="w.bin", path_or_fileobj=str(path))
    with plain.as_file() as file:  # without a listener: the base class's upload
        assert file.read() == b"x" * 1000
