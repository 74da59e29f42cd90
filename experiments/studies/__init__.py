"""Research drivers: scripts that study the method on held-out games, a run's replay or its adapters, as
against benchmarks/, which measures the system's speed and memory. Each is run by its path
(``python experiments/studies/NAME.py --help``) and says in its docstring what it reads and prints last.

* ``learning_curve``: held-out figures of every version of a run from empty, under honcho, for a wall time;
* ``warmup_switch``: a warm-up setting decided on held-out games, one run from empty per value;
* ``learner_setting``: one learner setting against another on the same stored samples (speed and held-out probes);
* ``reflect_discrimination``: does the revise probability ``p`` learn to discriminate (training variants);
* ``p_level``: where ``p`` sits against ``tau_p``, version by version;
* ``expert_path``: the draft policy on the handcoded expert's path, per verb;
* ``take_chances``: did the agent take the task's object when it could;
* ``cycle_stop``: is ``eval.cycle_stop``'s premise true, and what would it save;
* ``scienceworld_facts``: how much of what ScienceWorld says its fact parser can read.
"""
