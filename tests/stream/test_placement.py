"""Online mode plans only what it can place: a plan whose actors leave no node a whole CPU for Ray Data's
read tasks (the README's two-node cluster, 1 CPU a node: 0.75 and 0.25 left, a silent 20-minute hang) or
that needs a resource no node has is refused at start, in one line naming it."""

import os

import pytest

from diffusion.convert.pipeline import PoolPlan
from diffusion.errors import ConfigError
from diffusion.stream.ray_workers import check_placement
from diffusion.stream.stream_source import plan_online_pools
from diffusion.train.config import load_config

YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "yamls",
                    "tiny-online-cpu.yaml")


def test_a_plan_without_a_whole_cpu_for_the_reads_is_refused_and_one_that_fits_passes():
    cfg = load_config(YAML, ["data.online.input=raw"])
    pools = plan_online_pools({"CPU": 2.0}, cfg)  # what one 2-CPU box and two 1-CPU nodes both total
    check_placement([{"CPU": 2.0}], pools, cfg)  # one box: the read task has its CPU
    with pytest.raises(ConfigError) as refused:
        check_placement([{"CPU": 1.0}, {"CPU": 1.0}], pools, cfg)  # one box's plan on two small nodes
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("online mode cannot place its read tasks: each needs 1 CPU on one node"), message
    assert "the nodes have 0.5, 0.5 CPU left" in message and "data.online.num_train_workers or train_cpus" in message
    check_placement([{"CPU": 2.0}, {"CPU": 1.0}], pools, cfg)
    # planned for the two 1-CPU nodes: the read tasks ask for the half CPU each node keeps, and it places
    two_nodes = plan_online_pools({"CPU": 2.0}, cfg, nodes=2)
    assert two_nodes.cpus_per_task == 0.5 and two_nodes.num_encoders == pools.num_encoders
    check_placement([{"CPU": 1.0}, {"CPU": 1.0}], two_nodes, cfg)


def test_an_actor_no_node_can_hold_is_named():
    cfg = load_config(YAML, ["data.online.input=raw", "data.online.train_gpus=1"])
    pools = PoolPlan(1, 0.25, 1, 0.25, 0.0, 8)
    with pytest.raises(ConfigError, match=r"^online mode cannot place a training worker \(0.25 CPU, 1 GPU\) on "
                                          r"this cluster: its nodes have 2 CPU/0 GPU left"):
        check_placement([{"CPU": 2.0}], pools, cfg)
