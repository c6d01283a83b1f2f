"""Run by every Python process whose PYTHONPATH starts with this folder (tests/e2e/test_fidelity_with_trl.py): TRL's
trainer keeps each generation batch's rows in their order instead of shuffling them.

TRL shuffles a generation batch's rows (``shuffle_sequence_dict``, ``torch.randperm`` on the global RNG) before it
trains on them. Plain TRL draws that permutation from an RNG that its own sampling advanced; asyncgrpo's PS, which
does not sample, from one that never did. The rows are then summed in another order, and the loss and gradients
differ in their last digits. Without the shuffle on both sides, synchronous asyncgrpo and TRL seeded alike train
identically, to the bit.

The patch is applied when TRL's trainer module is first imported (an import hook), so that processes that never
import it do not pay for importing TRL; in a process forked from the test zygote, which has imported it, at once.
"""

# asyncgrpo.forkserver: runs in a fork too

import importlib.abc
import importlib.machinery
import sys

MODULE = "trl.trainer.grpo_trainer"


class _Unshuffled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.shuffle_sequence_dict = lambda batch: batch

        spec.loader.exec_module = exec_module
        return spec


if MODULE in sys.modules:
    sys.modules[MODULE].shuffle_sequence_dict = lambda batch: batch
else:
    sys.meta_path.insert(0, _Unshuffled())
