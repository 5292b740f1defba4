// Command kubecheck strictly decodes rendered Kubernetes objects into their k8s.io/api types,
// offline: an unknown or misspelt field, a duplicate key, a value of the wrong type or a kind
// it has no type for fails, as does a pod template whose mounts, probes or env name what it
// does not declare. It reads multi-document YAML (helm template's output) from the files
// named, or stdin; prints "ok <apiVersion> <kind> <name>" per object, or one line per fault
// and exits 1.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// serviceMonitor is the part of the Prometheus operator's ServiceMonitor (monitoring.coreos.com/v1)
// the chart renders: a CRD, so not in k8s.io/api; decoded as strictly as the rest.
type serviceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector *struct {
			MatchNames []string `json:"matchNames,omitempty"`
			Any        bool     `json:"any,omitempty"`
		} `json:"namespaceSelector,omitempty"`
		Endpoints []struct {
			Port          string `json:"port,omitempty"`
			Path          string `json:"path,omitempty"`
			Interval      string `json:"interval,omitempty"`
			ScrapeTimeout string `json:"scrapeTimeout,omitempty"`
			Scheme        string `json:"scheme,omitempty"`
		} `json:"endpoints"`
	} `json:"spec"`
}

func (s *serviceMonitor) GetObjectMeta() metav1.Object { return &s.ObjectMeta }

type object interface{ GetObjectMeta() metav1.Object }

// types maps "apiVersion kind" to a new value of its Go type.
var types = map[string]func() object{
	"v1 ConfigMap":             func() object { return &corev1.ConfigMap{} },
	"v1 Secret":                func() object { return &corev1.Secret{} },
	"v1 Service":               func() object { return &corev1.Service{} },
	"v1 ServiceAccount":        func() object { return &corev1.ServiceAccount{} },
	"v1 PersistentVolumeClaim": func() object { return &corev1.PersistentVolumeClaim{} },
	"v1 Pod":                   func() object { return &corev1.Pod{} },
	"apps/v1 Deployment":       func() object { return &appsv1.Deployment{} },
	"apps/v1 StatefulSet":      func() object { return &appsv1.StatefulSet{} },
	"batch/v1 Job":             func() object { return &batchv1.Job{} },
	"autoscaling/v2 HorizontalPodAutoscaler": func() object {
		return &autoscalingv2.HorizontalPodAutoscaler{}
	},
	"policy/v1 PodDisruptionBudget":      func() object { return &policyv1.PodDisruptionBudget{} },
	"networking.k8s.io/v1 NetworkPolicy": func() object { return &networkingv1.NetworkPolicy{} },
	"networking.k8s.io/v1 Ingress":       func() object { return &networkingv1.Ingress{} },
	"rbac.authorization.k8s.io/v1 Role":  func() object { return &rbacv1.Role{} },
	"rbac.authorization.k8s.io/v1 RoleBinding": func() object {
		return &rbacv1.RoleBinding{}
	},
	"monitoring.coreos.com/v1 ServiceMonitor": func() object { return &serviceMonitor{} },
}

// podSpec is the pod template of a workload, or nil.
func podSpec(o object) *corev1.PodSpec {
	switch v := o.(type) {
	case *corev1.Pod:
		return &v.Spec
	case *appsv1.Deployment:
		return &v.Spec.Template.Spec
	case *appsv1.StatefulSet:
		return &v.Spec.Template.Spec
	case *batchv1.Job:
		return &v.Spec.Template.Spec
	}
	return nil
}

// checkPod finds references strict decoding cannot: a mount of an undeclared volume, a
// probe on an undeclared port, a container without an image, an env var from nothing.
func checkPod(o object, spec *corev1.PodSpec) []string {
	var faults []string
	volumes := map[string]bool{}
	if sts, ok := o.(*appsv1.StatefulSet); ok {
		for _, claim := range sts.Spec.VolumeClaimTemplates {
			volumes[claim.Name] = true
		}
	}
	for _, v := range spec.Volumes {
		volumes[v.Name] = true
	}
	containers := append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
	if len(spec.Containers) == 0 {
		faults = append(faults, "no containers")
	}
	for _, c := range containers {
		if c.Name == "" || c.Image == "" {
			faults = append(faults, fmt.Sprintf("container %q: a name and an image are required", c.Name))
		}
		for _, m := range c.VolumeMounts {
			if !volumes[m.Name] {
				faults = append(faults, fmt.Sprintf("container %s mounts volume %q, which the pod does not declare", c.Name, m.Name))
			}
		}
		ports := map[string]bool{}
		for _, p := range c.Ports {
			ports[p.Name] = true
			ports[fmt.Sprint(p.ContainerPort)] = true
		}
		for what, probe := range map[string]*corev1.Probe{"readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe, "startupProbe": c.StartupProbe} {
			if probe == nil {
				continue
			}
			if probe.HTTPGet != nil && !ports[probe.HTTPGet.Port.String()] {
				faults = append(faults, fmt.Sprintf("container %s: %s on port %q, which it does not declare", c.Name, what, probe.HTTPGet.Port.String()))
			}
		}
		for _, e := range c.Env {
			if e.Value != "" && e.ValueFrom != nil {
				faults = append(faults, fmt.Sprintf("container %s: env %s has both value and valueFrom", c.Name, e.Name))
			}
		}
	}
	return faults
}

func check(doc []byte) (string, []string) {
	var meta metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &meta); err != nil {
		return "?", []string{err.Error()}
	}
	key := meta.APIVersion + " " + meta.Kind
	newObject, ok := types[key]
	if !ok {
		return key, []string{fmt.Sprintf("no API type known for apiVersion %q kind %q", meta.APIVersion, meta.Kind)}
	}
	o := newObject()
	if err := yaml.UnmarshalStrict(doc, o); err != nil {
		return key, []string{err.Error()}
	}
	name := o.GetObjectMeta().GetName()
	where := key + " " + name
	var faults []string
	if name == "" {
		faults = append(faults, "metadata.name is empty")
	}
	if spec := podSpec(o); spec != nil {
		faults = append(faults, checkPod(o, spec)...)
	}
	return where, faults
}

func run(in io.Reader, out io.Writer) (int, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(in))
	failed := 0
	for n := 1; ; n++ {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return failed, nil
		}
		if err != nil {
			return failed, err
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		where, faults := check(doc)
		if len(faults) == 0 {
			fmt.Fprintf(out, "ok %s\n", where)
			continue
		}
		failed++
		for _, f := range faults {
			fmt.Fprintf(out, "FAIL document %d (%s): %s\n", n, where, f)
		}
	}
}

// stripComments drops whole-line comments (helm template's "# Source:" lines), so that a
// document of comments alone counts as empty.
func stripComments(doc []byte) []byte {
	var kept []string
	for _, line := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			kept = append(kept, line)
		}
	}
	return []byte(strings.Join(kept, "\n"))
}

func main() {
	inputs := []io.Reader{os.Stdin}
	if len(os.Args) > 1 {
		inputs = nil
		for _, path := range os.Args[1:] {
			f, err := os.Open(path)
			if err != nil {
				fmt.Fprintln(os.Stderr, "kubecheck:", err)
				os.Exit(2)
			}
			defer f.Close()
			inputs = append(inputs, f)
		}
	}
	failed := 0
	for _, in := range inputs {
		n, err := run(in, os.Stdout)
		failed += n
		if err != nil {
			fmt.Fprintln(os.Stderr, "kubecheck:", err)
			os.Exit(2)
		}
	}
	if failed > 0 {
		fmt.Fprintf(os.Stderr, "kubecheck: %d object(s) failed\n", failed)
		os.Exit(1)
	}
}
