"""Lesson 05's code exercise `05-save-resume`: the learner's save and load run on the live ranks; the checker
accepts a DCP save of model and optimizer, and says in one line what a wrong one lost, without the code."""

import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from fsdplab.exercises import check

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the ranks get these functions by value


def save(model, opt, folder):
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)


def load(model, opt, folder):
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_model_only(model, opt, folder):
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)


def load_model_only(model, opt, folder):
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])


def save_on_rank0(model, opt, folder):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), f"{folder}/model.pt")


def load_file(model, opt, folder):
    model.load_state_dict(torch.load(f"{folder}/model.pt", weights_only=False))


def nothing(model, opt, folder):
    pass


def save_own_file_on_rank0(model, opt, folder):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), f"{folder}/rank{dist.get_rank()}.pt")


def load_own_file(model, opt, folder):
    model.load_state_dict(torch.load(f"{folder}/rank{dist.get_rank()}.pt"))


def test_the_right_save_and_load_pass(cluster):
    right = check("05-save-resume", (save, load), cluster=cluster)
    assert right.ok and "bit-identical" in right.message, right.message


def test_wrong_answers_are_told_what_they_lost(cluster):
    model_only = check("05-save-resume", (save_model_only, load_model_only), cluster=cluster)
    assert not model_only.ok and "optimizer's state was not restored" in model_only.message
    assert "step 4's loss differs by" in model_only.message      # step 3's loss comes before any update
    rank0 = check("05-save-resume", (save_on_rank0, load_file), cluster=cluster)
    assert not rank0.ok and "rank 1 got rank 0's rows" in rank0.message and "only rank 0's shard" in rank0.message
    no_load = check("05-save-resume", (save, nothing), cluster=cluster)
    assert not no_load.ok and no_load.message.startswith("nothing was loaded")
    stub = check("05-save-resume", (nothing, nothing), cluster=cluster)
    assert not stub.ok and stub.message.startswith("your save wrote nothing")
    for verdict in (model_only, rank0, no_load, stub):     # one line, and never the code
        assert "\n" not in verdict.message and "dcp." not in verdict.message and "state_dict(" not in verdict.message


def test_bad_answers_say_not_yet_without_a_traceback(cluster, capsys):
    assert "not one" in check("05-save-resume", save, cluster=cluster).message
    assert "int" in check("05-save-resume", (save, 3), cluster=cluster).message
    raised = check("05-save-resume", (save_own_file_on_rank0, load_own_file), cluster=cluster)
    assert not raised.ok and raised.message.startswith("your load raised on rank 1: FileNotFoundError:")
    assert "Traceback" not in capsys.readouterr().out
    assert cluster.run(dist.get_rank, quiet=True) == [0, 1]          # the group is still usable
