"""The postproc pool: tokens in, dialect frames out."""
