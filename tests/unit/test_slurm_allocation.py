"""The Slurm allocation against the config: filled in where unset, refused with both values where they differ."""

import pytest

from lit_dist.errors import ConfigError
from lit_dist.runtime.launch import check_allocation, tasks_per_node
from lit_dist.runtime.slurm import job_id


def slurm(**extra) -> dict:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_TASKS_PER_NODE": "4(x2)"}
    env.update(extra)
    return env


def test_tasks_per_node_are_read_from_slurms_compact_form():
    assert tasks_per_node({"SLURM_TASKS_PER_NODE": "2(x3),1"}) == [2, 2, 2, 1]
    assert tasks_per_node({"SLURM_TASKS_PER_NODE": "4"}) == [4]


def test_unset_devices_and_nodes_come_from_the_allocation():
    trainer = {"devices": "auto", "num_nodes": 1}
    filled = check_allocation(trainer, slurm())
    assert trainer == {"devices": 4, "num_nodes": 2}
    assert filled == ["trainer.devices 4 (Slurm tasks per node)", "trainer.num_nodes 2 (Slurm nodes)"]


def test_torchrun_layout_fills_nodes_and_devices_too():
    trainer = {"devices": "auto", "num_nodes": 1}
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "RANK": "2"}
    assert check_allocation(trainer, env) == ["trainer.devices 2 (torchrun processes per node)",
                                              "trainer.num_nodes 2 (torchrun nodes)"]
    with pytest.raises(ConfigError, match="trainer.devices: 1 but torchrun runs 2 processes per node \\(--nproc-per-node\\)"):
        check_allocation({"devices": 1, "num_nodes": 2}, env)


def test_outside_slurm_nothing_changes():
    trainer = {"devices": "auto", "num_nodes": 1}
    assert check_allocation(trainer, {}) == [] and trainer == {"devices": "auto", "num_nodes": 1}
    interactive = slurm(SLURM_JOB_NAME="interactive")
    assert check_allocation(trainer, interactive) == []


def test_disagreements_name_both_values_and_the_fix():
    with pytest.raises(ConfigError) as err:
        check_allocation({"devices": 8, "num_nodes": 4}, slurm())
    message = str(err.value)
    assert "trainer.devices: 8 but Slurm runs 4 tasks per node" in message and "--ntasks-per-node=8" in message
    assert "trainer.num_nodes: 4 but the Slurm job step has 2 nodes" in message and "--nodes=4" in message


def test_unequal_tasks_per_node_are_refused():
    with pytest.raises(ConfigError, match=r"unequal tasks per node \(2\(x2\),1\)"):
        check_allocation({"devices": "auto", "num_nodes": 1},
                         slurm(SLURM_NTASKS="5", SLURM_JOB_NUM_NODES="3", SLURM_TASKS_PER_NODE="2(x2),1"))


def test_array_tasks_are_requeued_by_their_own_id():
    assert job_id({"SLURM_JOB_ID": "101", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "1"}) == "100_1"
    assert job_id({"SLURM_JOB_ID": "101"}) == "101"
