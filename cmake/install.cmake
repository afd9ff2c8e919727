# install rules: see issue 2 (filled in by the build task)
