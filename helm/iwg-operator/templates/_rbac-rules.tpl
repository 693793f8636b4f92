{{/*
What the operator does with the API, and nothing more (tests/helm/test_install.py runs the operator with
these rules and fails on any 403 and on any rule it never exercised). No wildcards.
*/}}

{{/*
Rules in every namespace the operator handles. None is cluster-scoped: Kopf runs with scanning disabled
(iwg_operator.runtime), so it neither lists CRDs nor namespaces.
*/}}
{{- define "iwg-operator.namespacedRules" -}}
# The groups: watched (Kopf keeps no annotation or finalizer on them), their status written, their replicas
# set by the autoscaler through the scale subresource (the right to scale, not to edit the spec).
- apiGroups: [inference.iwg.dev]
  resources: [inferenceworkergroups]
  verbs: [list, watch]
- apiGroups: [inference.iwg.dev]
  resources: [inferenceworkergroups/status, inferenceworkergroups/scale]
  verbs: [patch]
# Worker pods: an index fed by a watch, created and replaced one by one.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
# The group's children: driver Deployment, Services, CURVE Secret, ConfigMap, NetworkPolicy, PDB. Watched
# (filtered by the label app.kubernetes.io/managed-by=iwg-operator on the server) so that one deleted or edited
# by hand is repaired; list and watch on Secrets let the operator read every Secret of these namespaces, as
# get already does by name. Secrets are deleted only to replace a group's keys (rotate-keys, or the one-keypair
# Secret of an earlier version): the Secret is immutable.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch, create, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
# Gang placement (scheduling.k8s.io/v1beta1, where the cluster serves it): one Workload per group, replaced
# when the world size changes (its templates are fixed); one PodGroup per replica, kept in an index fed by a
# watch, created before the replica's pods and deleted before them.
- apiGroups: [scheduling.k8s.io]
  resources: [workloads]
  verbs: [get, create, delete]
- apiGroups: [scheduling.k8s.io]
  resources: [podgroups]
  verbs: [list, watch, create, delete]
# Kubernetes Events for what the operator did.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}


{{/*
Leader election, in the release's namespace only: the replicas' Lease is created once, then read and renewed
by name (create cannot be limited to a name: Kubernetes does not know it before the object exists).
*/}}
{{- define "iwg-operator.leaderElectionRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{{ include "iwg-operator.fullname" . }}]
  verbs: [get, update]
{{- end -}}
