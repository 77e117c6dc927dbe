"""The course around the lectures: the exercises and their generated stubs (``exercises``,
``exercise_stubs``), grading (``grade``, and the pytest plugin it runs, ``grading_plugin``),
``show`` (``source``: a function's code, printed in a lecture) and ``doctor`` (is this machine
ready?). Nothing in the techniques imports it."""
