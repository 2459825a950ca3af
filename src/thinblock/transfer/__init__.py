"""Moving volumes in and out of a pool: images, exports, rbd diffs, sparsify.

images.py reads and writes the outside world (raw files, streams, NBD);
jobs.py runs the work on an open pool, in whichever process holds it.
"""
