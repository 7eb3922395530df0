"""The compiler: drives the passes (``fxpipe.passes``) from a model and a Plan to a
``Partitioned`` program, one ``Stage`` per cut, with the compile-time facts the runtimes
read (shapes, costs, memory kept per micro-batch). It builds no pipeline: ``fxpipe.factory``
hands the result to the local or the distributed runtime."""
