"""Run under torchrun by test_training_host_sync.py, as examples/pretrain_single_gpu.sh launches: the training entry
(`megafp8.pretrain.main`, which initializes the one-process group) with every host read and copy counted per
iteration; the counts are written to the JSON file named by $HOST_SYNC_PROBE_OUT once training returns (main then
leaves the process with os._exit)."""
import json
import os
import sys

from host_sync_counting import HostReads

from megafp8 import pretrain
from megafp8.training import train as train_module

reads = HostReads()
reads.install()
original_train = train_module.Trainer.train


def train_and_report(trainer):
    progress = original_train(trainer)
    with open(os.environ["HOST_SYNC_PROBE_OUT"], "w") as f:
        json.dump({str(k): v for k, v in reads.reads.items()}, f)
    return progress


train_module.Trainer.train = train_and_report
with reads:
    sys.exit(pretrain.main(sys.argv[1:]))
