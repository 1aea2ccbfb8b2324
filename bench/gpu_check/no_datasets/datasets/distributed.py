"""See datasets/__init__.py: the stand-in's `split_dataset_by_node`, never called in a synthetic-token run."""


def split_dataset_by_node(*args, **kwargs):
    raise RuntimeError("datasets is not installed: this is the GPU check's stand-in "
                       "(bench/gpu_check/no_datasets); a synthetic-token run needs no dataset")
