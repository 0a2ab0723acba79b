"""hvdtrain.launch.ranks.shared_visible_devices: the CUDA_VISIBLE_DEVICES each Spark task's rank
gets from the GPUs Spark assigned (#48); the end-to-end check is in tests/spark."""
from hvdtrain.launch.ranks import shared_visible_devices, slot_plan


def test_ranks_of_a_host_share_its_gpus_in_local_rank_order():
    plan = slot_plan(["a", "b", "a", "b"])  # tasks 0, 2 on a; 1, 3 on b
    assert [(s.hostname, s.local_rank) for s in plan] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    visible = shared_visible_devices(plan, [["2"], ["0", "1"], ["7"], ["3"]])
    # Host a: local rank 0 was given GPU 2, local rank 1 GPU 7; a task given two keeps its first.
    assert visible == ["2,7", "0,3", "2,7", "0,3"]
    for slot, value, given in zip(plan, visible, [["2"], ["0", "1"], ["7"], ["3"]]):
        assert value.split(",")[slot.local_rank] == given[0]


def test_no_gpus_assigned_leaves_the_environment_alone():
    plan = slot_plan(["a", "a", "b"])
    assert shared_visible_devices(plan, [[], [], []]) == [None, None, None]
    # Only host b's tasks were given GPUs: host a's ranks keep the executor's environment.
    assert shared_visible_devices(plan, [["1"], [], ["4"]]) == [None, None, "4"]


def test_a_gpu_given_to_two_tasks_is_listed_once():
    # spark.task.resource.gpu.amount=0.5: two ranks, one GPU; init() then refuses (NCCL cannot
    # put two ranks on one GPU) instead of both ranks naming the same device twice.
    plan = slot_plan(["a", "a"])
    assert shared_visible_devices(plan, [["0"], ["0"]]) == ["0", "0"]
