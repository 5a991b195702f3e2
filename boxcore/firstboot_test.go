package boxcore

import (
	"errors"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore/templates"
)

// VM settings (secure boot off for cloud images whose shim the firmware rejects) go on VMs
// only; containers never carry them.
func TestApplyTemplateVMSettings(t *testing.T) {
	tmpl, err := templates.Get("claude")
	if err != nil {
		t.Fatal(err)
	}
	if len(tmpl.VMConfig) == 0 || tmpl.VMConfig["security.secureboot"] != "false" {
		t.Fatalf("the claude template's VM config: %v", tmpl.VMConfig)
	}
	vm := NewOptions{Name: "v", VM: true}
	ct := NewOptions{Name: "c"}
	for _, o := range []*NewOptions{&vm, &ct} {
		if err := ApplyTemplate(o, TemplateChoice{Template: tmpl, HostCAs: nil}); err != nil {
			t.Fatal(err)
		}
	}
	for k, v := range tmpl.VMConfig {
		if vm.Config[k] != v {
			t.Errorf("VM lacks %s=%s", k, v)
		}
		if _, ok := ct.Config[k]; ok {
			t.Errorf("container carries VM setting %s", k)
		}
	}
	// The docker template's container settings (nesting) go on containers only.
	dt, _ := templates.Get("docker")
	dvm, dct := NewOptions{Name: "v", VM: true}, NewOptions{Name: "c"}
	for _, o := range []*NewOptions{&dvm, &dct} {
		if err := ApplyTemplate(o, TemplateChoice{Template: dt}); err != nil {
			t.Fatal(err)
		}
	}
	if len(dt.ContainerConfig) == 0 || dct.Config["security.nesting"] != "true" || dvm.Config["security.nesting"] != "" || dvm.Config["security.secureboot"] != "false" {
		t.Errorf("docker: container %v, VM %v", dct.Config, dvm.Config)
	}
	if vm.Image != tmpl.Image.VM || ct.Image != tmpl.Image.Container {
		t.Errorf("images: vm %q container %q", vm.Image, ct.Image)
	}
	if ct.CPU != "2" || ct.Memory != tmpl.Resources.Memory || ct.Disk != tmpl.Resources.Disk {
		t.Errorf("resources: %q %q %q", ct.CPU, ct.Memory, ct.Disk)
	}
	if !strings.HasPrefix(ct.Config["cloud-init.user-data"], "#cloud-config") || ct.Config[TagTemplate] != "claude" {
		t.Errorf("user-data or template tag missing: %v", ct.Config[TagTemplate])
	}
	if _, ok := ct.Config["cloud-init.vendor-data"]; ok {
		t.Error("vendor-data without host CAs")
	}
	// Flags win over the template's defaults.
	o := NewOptions{Name: "f", CPU: "1", Memory: "1GiB", Disk: "5GiB", Image: "local-alias"}
	if err := ApplyTemplate(&o, TemplateChoice{Template: tmpl}); err != nil {
		t.Fatal(err)
	}
	if o.CPU != "1" || o.Memory != "1GiB" || o.Disk != "5GiB" || o.Image != "local-alias" {
		t.Errorf("flags overridden: %+v", o)
	}
}

// While a VM's guest agent is not up, exec fails with the daemon's words; those are retried,
// everything else is not.
func TestAgentNotReady(t *testing.T) {
	for _, msg := range []string{
		"incus: operation x failed: VM agent isn't currently running",
		"Failed to connect to the VM agent: dial vsock",
	} {
		if !agentNotReady(errors.New(msg)) {
			t.Errorf("%q not recognised as agent-not-ready", msg)
		}
	}
	for _, msg := range []string{"Command not found", "Instance is not running", "context deadline exceeded"} {
		if agentNotReady(errors.New(msg)) {
			t.Errorf("%q taken for agent-not-ready", msg)
		}
	}
	if !isCommandNotFound(errors.New("incus: operation x failed: Command not found")) {
		t.Error("command not found not recognised")
	}
}

func TestFirstBootErrorNamesStageAndLog(t *testing.T) {
	e := &FirstBootError{Box: "b", Summary: "cloud-init error", Stage: "modules-final: scripts-user failed", LogTail: "line1\nline2\n"}
	s := e.Error()
	for _, w := range []string{"box b did not finish its first boot: cloud-init error", "failing stage: modules-final", "line2"} {
		if !strings.Contains(s, w) {
			t.Errorf("%q lacks %q", s, w)
		}
	}
}
