"""The CoMap method in one place: what a process decides about learning, as pure functions.

Read in this order:

1. :mod:`comap_async.method.gates` - the action gate (execute the reflected action only when the
   policy is confident it should revise, ``p > tau_p``, in an action it trusts, ``q > tau_q``, that
   differs from the draft), the world-state gate (show the imagined next state only where the student
   and the EMA teacher agree on the facts it changes, F1 >= ``tau_ws``), and the reflection sample a
   co-evolution transition becomes (:class:`~comap_async.method.gates.SampleRule`);
2. :mod:`comap_async.method.decision` - the action gate's two numbers, each one function for the actor's
   logprobs and the learner's logits alike: ``p``, the sigmoid of the decision logit ``revise - keep``
   (the learner's BCE takes that logit), and ``q``, the reflected action's geometric-mean token
   probability;
3. :mod:`comap_async.method.labels` - what a branch comparison means: the reflection-mode
   initialisation's label (``y = 1`` only when the expert's branch does strictly better than the
   draft's) and the evaluation's URR, HRR and BRP;
4. :mod:`comap_async.method.routing` - the phases and what each trains on: the stores, the phase
   filters, the mixed-in shares, and the ablations that leave data or loss terms out;
5. :mod:`comap_async.method.phases` - each phase as one spec built from ``learner.phases.<phase>``:
   its stores, when it starts and ends (budget, sized by data, capped in time), its rate and publishing;
   and co-evolution's mixed-in shares.

The losses themselves are in ``learner/losses.py`` (one small function per term, on tensors, composed once
by ``step_loss``). The ablation flags, the gate thresholds and the phases' settings are read here and
nowhere else, and ``p``, ``q``, the labels and the reflection metrics computed nowhere else
(``tests/unit/test_method_boundary.py``).
The definitions follow docs/design.md section 11.
"""
