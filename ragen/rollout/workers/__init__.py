"""The workers of the parallel backends: executors kept between rollouts
(``executors``), Dask and Ray clusters (``cluster``), how many workers a
rollout uses (``autosize``), and the queue of groups they take (``schedule``)."""
