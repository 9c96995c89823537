"""The workers of the parallel backends: executors kept between rollouts
(``executors``), Dask and Ray clusters (``cluster``), how many workers a
rollout uses (``autosize``), the queue of groups they take (``schedule``), and
the messages that take them over the shared manager's connection (``dispatch``)."""
