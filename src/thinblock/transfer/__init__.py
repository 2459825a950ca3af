"""Moving volumes in and out of a pool: images, exports, rbd diffs, sparsify.

images.py reads and writes the outside world (raw files, streams, NBD);
imaging.py, rbdimage.py (rbd image streams out, with their snapshots), diffs.py
and sparsify.py run the work on an open pool, in whichever
process holds it: the command itself when no one else does, or the server,
which gets the command's open files over the control socket (admin/jobs.py).
They call the volume verbs of core/volume.py and nothing below them, so every
rule of the block contract still holds, and report through a ProgressFn,
which may raise to cancel them. common.py has what they share.

Zeros are free both ways: what a source says is a hole or reads zero is never
read, all-zero blocks are never written, and what the pool knows reads zero is
never read from its data store.
"""
