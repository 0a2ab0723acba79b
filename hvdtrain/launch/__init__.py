"""Everything before the ranks run: hostfiles (:mod:`~hvdtrain.launch.hostfile`), Slurm
allocations (:mod:`~hvdtrain.launch.slurm`), Open MPI and Horovod settings
(:mod:`~hvdtrain.launch.tuning`), the multi-host pre-flight (:mod:`~hvdtrain.launch.preflight`),
``hvdtrain doctor`` (:mod:`~hvdtrain.launch.doctor`), and ``hvdtrain launch`` itself: one plan
per launch (:mod:`~hvdtrain.launch.plan`) and the signals handed on to the ranks
(:mod:`~hvdtrain.launch.signals`).

Nothing here imports a framework: the CLI validates a launch in a second.
"""
