"""Sharded (FSDP ``state_dict_type: sharded``) checkpoints' reads never run code: a ``.metadata`` index or a
non-tensor entry that would run code when unpickled is refused in one line.

Their real 2-rank runs (``run.py``'s own command over gloo: autoresume from the last complete checkpoint folder,
incomplete folders set aside, pruning, unreadable folders refused unless ``trainer.start_fresh=true``, the save
folder's lock, and a hostile ``trainer.load_path`` refused by every rank) run in tests/train/test_fsdp.py's launch,
each rank's steps after its FSDP variants: a launch is mostly three processes importing torch and Composer.
"""

import pickle

import pytest
import torch

from train_fixtures import OpensWhenUnpickled


def test_a_sharded_index_or_entry_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp
    from diffusion.errors import InputError
    from diffusion.models import safe_checkpoint
    marker = tmp_path / "ran"
    # 1. a .metadata that calls open() when unpickled, beside a real checkpoint's shards
    hostile_index = tmp_path / "ep0-ba5"
    dcp.save({"weight": torch.ones(2), "step": 5}, checkpoint_id=str(hostile_index))
    with open(hostile_index / ".metadata", "wb") as f:
        pickle.dump(OpensWhenUnpickled(str(marker)), f)
    with pytest.raises(InputError, match=r"\.metadata: refused: the sharded checkpoint's index asks to call "
                                         r"(builtins|io)\.open"):
        safe_checkpoint.check_sharded(hostile_index)
    safe_checkpoint.guard_sharded_loads()
    with pytest.raises(InputError, match="refused"):
        dcp.FileSystemReader(str(hostile_index)).read_metadata()
    # 2. a well-formed index whose non-tensor entry calls open()
    hostile_entry = tmp_path / "entry"
    dcp.save({"weight": torch.ones(2), "extra": OpensWhenUnpickled(str(marker))}, checkpoint_id=str(hostile_entry))
    with pytest.raises(InputError, match=r"\(extra\): refused: the checkpoint asks to call (builtins|io)\.open"):
        safe_checkpoint.check_sharded(hostile_entry)
    target = {"weight": torch.zeros(2), "extra": None}
    with pytest.raises(BaseException) as raised:  # torch wraps each rank's error in a CheckpointException
        dcp.load(target, checkpoint_id=str(hostile_entry))
    failures = [exc for exc, _ in raised.value.failures.values()]
    assert failures and all(isinstance(exc, InputError) and "refused: the checkpoint asks to call" in str(exc)
                            for exc in failures)
    assert not marker.exists()
